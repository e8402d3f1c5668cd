"""The argument checks of the layers and models: one message form, the argument, the value, what is allowed."""
import pytest

from timm_hbf._checks import check_choice, check_count, check_divisor, check_positive


@pytest.mark.parametrize('check, value, error, message', [
    (check_count, 0, ValueError, r'^n must be an integer >= 1, got 0\.$'),
    (check_count, 2.0, TypeError, r'^n must be an integer >= 1, got 2\.0 \(float\)\.$'),
    (check_count, True, TypeError, r'^n must be an integer >= 1, got True \(bool\)\.$'),
    (check_positive, float('nan'), ValueError, r'^n must be a finite number > 0, got nan\.$'),
    (check_positive, '1', TypeError, r"^n must be a finite number > 0, got '1' \(str\)\.$"),
])
def test_a_bad_value_raises_naming_the_argument_the_value_and_what_is_allowed(check, value, error, message):
    with pytest.raises(error, match=message):
        check('n', value)


def test_a_choice_must_be_one_of_those_named():
    check_choice('kernel', 'dot', ('dot', 'gaussian'))
    with pytest.raises(ValueError, match=r"^kernel must be one of \('dot', 'gaussian'\), got 'Dot'\.$"):
        check_choice('kernel', 'Dot', ['dot', 'gaussian'])


@pytest.mark.parametrize('check, value', [(check_count, 1), (check_positive, 1e-9)])
def test_a_good_value_passes(check, value):
    check('n', value)


def test_a_divisor_names_what_it_must_divide():
    check_divisor('num_heads', 3, 'dim', 192)
    with pytest.raises(ValueError, match=r'^num_heads must be a divisor of dim \(50\), got 3\.$'):
        check_divisor('num_heads', 3, 'dim', 50)


def test_a_count_may_start_elsewhere():
    check_count('num_classes', 0, low=0)
    with pytest.raises(ValueError, match=r'^num_classes must be an integer >= 0, got -1\.$'):
        check_count('num_classes', -1, low=0)
