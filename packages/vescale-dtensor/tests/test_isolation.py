"""vescale-dtensor imports only the vescale packages it declares (see docs/architecture.md)."""

from vescale.core.testing import imported_vescale_packages


def test_imports_only_declared_siblings():
    assert imported_vescale_packages("vescale.dtensor") <= {"core", "dtensor"}
