"""The public API is pinned: adding or removing a name is a deliberate, reviewed change."""

import durable

EXPECTED = {
    "__version__",
    "DurableError",
    "GiveUp",
    "handler",
    "schedule",
    "schedule_many",
    "cancel",
    "schedule_celery",
    "Backoff",
    "current_fire",
    "cron",
    "every",
    "Occurrence",
    "schedules",
    "workflow",
    "Workflow",
    "WorkflowContext",
    "send_signal",
    "cancel_workflow",
}


def test_all_is_pinned():
    assert set(durable.__all__) == EXPECTED
    assert len(durable.__all__) == len(set(durable.__all__))


def test_every_exported_name_resolves_and_is_documented():
    for name in durable.__all__:
        value = getattr(durable, name)
        if name != "__version__":
            assert (value.__doc__ or "").strip(), f"durable.{name} has no docstring"


def test_unknown_attribute_raises_attribute_error():
    try:
        durable.no_such_thing  # noqa: B018
    except AttributeError as exc:
        assert "no_such_thing" in str(exc)
    else:
        raise AssertionError("expected AttributeError")
