"""vescale-core imports no other vescale package."""

import pytest

from vescale.core.testing import imported_vescale_packages


def test_core_imports_only_itself():
    assert imported_vescale_packages("vescale.core") == {"core"}
    assert imported_vescale_packages("vescale.core.testing") == {"core"}


def test_a_failing_import_is_reported():
    with pytest.raises(ImportError, match="vescale.nonexistent"):
        imported_vescale_packages("vescale.nonexistent")
