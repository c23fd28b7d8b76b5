"""trainbridge.runtime.timeout: the one timeout, a positive, finite number of seconds or one line."""
import math

import pytest

from trainbridge.errors import UserError
from trainbridge.runtime.timeout import check_timeout


@pytest.mark.parametrize("seconds", [math.nan, math.inf, 0, -5.0])
def test_a_timeout_no_clock_reaches_is_one_line(seconds):
    with pytest.raises(UserError, match=rf"^timeout must be a positive, finite number of seconds \(got {seconds}\); "
                                        r"it bounds every wait for the other ranks \(default 300\)$"):
        check_timeout(seconds)


@pytest.mark.parametrize("seconds", ["30", None, True])
def test_a_timeout_that_is_not_a_number_is_one_line_not_a_type_error(seconds):
    with pytest.raises(UserError, match=rf"^timeout must be a number of seconds, got the {type(seconds).__name__} "
                                        rf"{seconds!r}; pass a number \(default 300\)$"):
        check_timeout(seconds)


def test_a_number_of_seconds_is_taken():
    assert check_timeout(30) == 30.0 and check_timeout(0.5, "TRAINBRIDGE_HVD_TIMEOUT=0.5") == 0.5
