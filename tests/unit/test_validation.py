"""What schedule() accepts, refuses, and how its errors name the problem (no database)."""

import json
import math
from datetime import UTC, date, datetime, timedelta, timezone
from decimal import Decimal
from enum import IntEnum, StrEnum

import pytest
from hypothesis import given
from hypothesis import strategies as st

from durable.core.backoff import Backoff
from durable.core.timeutil import ceil_ms, datetime_to_ms, ms_to_datetime
from durable.exceptions import PayloadError, TimerError
from durable.scheduling.validation import (
    check_json,
    check_key,
    check_max_attempts,
    check_payload,
    fire_at_ms,
    json_size_bound,
    to_backoff,
)

NOW = 1_700_000_000_000

# -- time ---------------------------------------------------------------------------------


def test_neither_at_nor_delay_is_due_now():
    assert fire_at_ms(None, None, NOW) == NOW


def test_delay_is_added_to_now():
    assert fire_at_ms(None, timedelta(seconds=90), NOW) == NOW + 90_000
    assert fire_at_ms(None, timedelta(0), NOW) == NOW


def test_at_is_converted_to_utc_epoch_ms_whatever_its_zone():
    paris_summer = timezone(timedelta(hours=2))
    at = datetime(2024, 6, 1, 14, 0, tzinfo=paris_summer)
    assert (
        fire_at_ms(at, None, NOW) == int(datetime(2024, 6, 1, 12, 0, tzinfo=UTC).timestamp()) * 1000
    )


def test_at_in_the_past_is_accepted():
    assert fire_at_ms(datetime(2001, 1, 1, tzinfo=UTC), None, NOW) == 978_307_200_000


def test_sub_millisecond_instants_round_up_never_early():
    at = datetime(2024, 1, 1, tzinfo=UTC) + timedelta(microseconds=1)
    assert fire_at_ms(at, None, NOW) == datetime_to_ms(datetime(2024, 1, 1, tzinfo=UTC)) + 1
    assert fire_at_ms(None, timedelta(microseconds=1), NOW) == NOW + 1


def test_naive_datetime_is_refused_with_a_hint():
    with pytest.raises(ValueError, match=r"^at: naive datetime .*django\.utils\.timezone\.now"):
        fire_at_ms(datetime(2030, 1, 1), None, NOW)


def test_negative_delay_is_refused_naming_delay():
    with pytest.raises(ValueError, match=r"^delay: must not be negative"):
        fire_at_ms(None, timedelta(seconds=-1), NOW)


@pytest.mark.parametrize("delay", [5, 5.0, "5s"])
def test_delay_must_be_a_timedelta(delay):
    with pytest.raises(TypeError, match=r"^delay: expected a timedelta"):
        fire_at_ms(None, delay, NOW)


@pytest.mark.parametrize("at", [date(2030, 1, 1), "2030-01-01T00:00:00Z", 1_900_000_000])
def test_at_must_be_a_datetime(at):
    with pytest.raises(TypeError, match=r"^at: expected an aware datetime"):
        fire_at_ms(at, None, NOW)


def test_at_and_delay_together_are_refused():
    with pytest.raises(ValueError, match="at most one of at= and delay="):
        fire_at_ms(datetime(2030, 1, 1, tzinfo=UTC), timedelta(1), NOW)


def test_messages_carry_the_spec_prefix():
    with pytest.raises(ValueError, match=r"^specs\[3\]\.delay: "):
        fire_at_ms(None, timedelta(days=-1), NOW, "specs[3]")


def test_time_helpers_round_trip_exactly():
    assert ceil_ms(timedelta(microseconds=-1)) == 0
    assert ceil_ms(timedelta(milliseconds=-3)) == -3
    for ms in (0, 1, 1_700_000_000_123, -5):
        assert datetime_to_ms(ms_to_datetime(ms)) == ms
    with pytest.raises(ValueError, match="naive"):
        datetime_to_ms(datetime(2030, 1, 1))


# -- keys and policies --------------------------------------------------------------------


def test_key_rules():
    assert check_key(None) is None
    assert check_key("k" * 255) == "k" * 255
    with pytest.raises(ValueError, match=r"^key: must be 1 to 255 characters, got 0"):
        check_key("")
    with pytest.raises(ValueError, match=r"^key: must be 1 to 255 characters, got 256"):
        check_key("k" * 256)
    with pytest.raises(TypeError, match=r"^key: expected a str, got int"):
        check_key(7)


def test_max_attempts_rules():
    assert check_max_attempts(None) is None
    assert check_max_attempts(1) == 1
    with pytest.raises(ValueError, match=r"^max_attempts: must be >= 1, got 0"):
        check_max_attempts(0)
    for bad in (True, 2.0, "3"):
        with pytest.raises(TypeError, match=r"^max_attempts: expected an int >= 1"):
            check_max_attempts(bad)
    with pytest.raises(ValueError, match=r"^specs\[1\]\.max_attempts"):
        check_max_attempts(-1, "specs[1]")


def test_backoff_rules():
    policy = Backoff(base_s=2.0, max_s=10.0)
    assert to_backoff(policy, 3600.0) is policy
    assert to_backoff(None, 3600.0) is None
    assert to_backoff(timedelta(seconds=30), 600.0) == Backoff(base_s=30.0, max_s=600.0)
    with pytest.raises(ValueError, match=r"^backoff: the base delay must be positive"):
        to_backoff(timedelta(0), 3600.0)
    with pytest.raises(ValueError, match=r"^backoff: base delay .* exceeds .*BACKOFF_MAX_S"):
        to_backoff(timedelta(hours=2), 3600.0)
    with pytest.raises(TypeError, match=r"^backoff: expected a durable\.Backoff or a timedelta"):
        to_backoff(5, 3600.0)


# -- payloads -----------------------------------------------------------------------------


def test_valid_payload_comes_back_normalized():
    args, kwargs = check_payload(("a", 1, 2.5, True, None, [1, (2,)]), None, {"x": [1]}, 10_000)
    assert args == ["a", 1, 2.5, True, None, [1, (2,)]]
    assert kwargs == {}


@pytest.mark.parametrize(
    ("args", "kwargs", "context", "message"),
    [
        ([1, {"when": datetime(2030, 1, 1)}], {}, None, r"^args\[1\]\['when'\]: datetime is not"),
        ([], {"x": float("nan")}, None, r"^kwargs\['x'\]: float nan is not JSON$"),
        ([], {"x": [0, float("inf")]}, None, r"^kwargs\['x'\]\[1\]: float inf is not JSON$"),
        ([Decimal("1.5")], {}, None, r"^args\[0\]: Decimal is not JSON-serializable$"),
        ([{1: "a"}], {}, None, r"^args\[0\]: dict key 1 is int; JSON keys must be str$"),
        ([], {}, {"s": {1, 2}}, r"^context\['s'\]: set is not JSON-serializable$"),
        (["a\x00b"], {}, None, r"^args\[0\]: str contains NUL"),
        ([{"k\x00": 1}], {}, None, r"^args\[0\]: str contains NUL"),
        (["\ud800"], {}, None, r"^args\[0\]: str contains a lone surrogate"),
        ([b"bytes"], {}, None, r"^args\[0\]: bytes is not JSON-serializable$"),
    ],
)
def test_bad_payload_names_the_path(args, kwargs, context, message):
    with pytest.raises(PayloadError, match=message) as info:
        check_payload(args, kwargs, context, 64 * 1024)
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, TimerError)
    assert info.value.path == str(info.value).split(":")[0]


def test_kwargs_keys_must_be_str():
    with pytest.raises(PayloadError, match=r"^kwargs: dict key 3 is int"):
        check_payload([], {3: "x"}, None, 1000)


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        ("abc", None, r"^args: expected a list or tuple, got str$"),
        ({"a": 1}, None, r"^args: expected a list or tuple, got dict$"),
        ([], [("a", 1)], r"^kwargs: expected a dict, got list$"),
    ],
)
def test_args_and_kwargs_shapes(args, kwargs, message):
    with pytest.raises(PayloadError, match=message):
        check_payload(args, kwargs, None, 1000)


def test_spec_prefix_in_payload_paths():
    with pytest.raises(PayloadError, match=r"^specs\[12\]\.args\[0\]: datetime"):
        check_payload([datetime.now(UTC)], {}, None, 1000, "specs[12]")


def test_reference_cycle_is_reported_not_a_crash():
    loop: list = []
    loop.append(loop)
    with pytest.raises(PayloadError, match="nested more than 100 levels deep"):
        check_json(loop, "args")


def test_enum_members_are_json_like_their_values():
    class Color(StrEnum):
        RED = "red"

    class Level(IntEnum):
        HIGH = 3

    check_json([Color.RED, Level.HIGH, {"c": Color.RED}], "args")


def test_oversized_payload_gives_size_and_limit():
    # ["x...x"] is 1004 bytes and {} two more; a None context is not stored, not counted.
    with pytest.raises(
        PayloadError, match=r"is 1006 bytes of JSON; the limit is .* = 1000"
    ) as info:
        check_payload(["x" * 1000], {}, None, 1000)
    assert info.value.limit == 1000
    assert info.value.size == 1006
    check_payload(["x" * 994], {}, None, 1000)  # exactly 1000 bytes is allowed


def test_size_counts_utf8_bytes_not_characters():
    # 300 three-byte characters: 902 bytes encoded with the list brackets, under 1000.
    check_payload(["€" * 300], {}, None, 1000)
    with pytest.raises(PayloadError, match="bytes of JSON"):
        check_payload(["€" * 400], {}, None, 1000)


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(st.characters(exclude_categories=["Cs"], exclude_characters="\x00")),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(
            st.text(
                st.characters(exclude_categories=["Cs"], exclude_characters="\x00"), max_size=5
            ),
            children,
            max_size=4,
        )
    ),
    max_leaves=20,
)


@given(json_values)
def test_size_bound_is_never_below_the_real_size(value):
    real = len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())
    assert json_size_bound(value, "v") >= real


@given(st.floats())
def test_floats_are_json_only_when_finite(value):
    if math.isfinite(value):
        check_json(value, "v")
    else:
        with pytest.raises(PayloadError, match=r"^v: float"):
            check_json(value, "v")
