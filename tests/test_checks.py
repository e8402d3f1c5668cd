"""The argument checks of the layers and models: one message form, the argument, the value, what is allowed."""
import pytest

from timm_hbf._checks import check_choice, check_count, check_divisor, check_positive


@pytest.mark.parametrize('check, args, error, message', [
    (check_count, ('n', 0), ValueError, r'^n must be an integer >= 1, got 0\.$'),
    (check_count, ('n', 2.0), TypeError, r'^n must be an integer >= 1, got 2\.0 \(float\)\.$'),
    (check_count, ('n', True), TypeError, r'^n must be an integer >= 1, got True \(bool\)\.$'),
    (check_count, ('num_classes', -1, 0), ValueError, r'^num_classes must be an integer >= 0, got -1\.$'),  # low
    (check_positive, ('n', float('nan')), ValueError, r'^n must be a finite number > 0, got nan\.$'),
    (check_positive, ('n', '1'), TypeError, r"^n must be a finite number > 0, got '1' \(str\)\.$"),
    (check_choice, ('kernel', 'Dot', ['dot', 'gaussian']), ValueError,
     r"^kernel must be one of \('dot', 'gaussian'\), got 'Dot'\.$"),
    (check_divisor, ('num_heads', 3, 'dim', 50), ValueError, r'^num_heads must be a divisor of dim \(50\), got 3\.$'),
])
def test_a_bad_value_raises_naming_the_argument_the_value_and_what_is_allowed(check, args, error, message):
    with pytest.raises(error, match=message):
        check(*args)


def test_a_good_value_passes():
    check_count('n', 1)
    check_count('num_classes', 0, low=0)
    check_positive('n', 1e-9)
    check_choice('kernel', 'dot', ('dot', 'gaussian'))
    check_divisor('num_heads', 3, 'dim', 192)
