"""Every key of ``DurableSettings`` has a rule: an unchecked setting cannot be added.

The rules themselves (type, range, the check ids and messages) are exercised key by key
in tests/integration/test_settings_checks.py.
"""

from __future__ import annotations

import dataclasses

from durable.conf import RELATIONS, RULES, DurableSettings


def test_every_setting_has_a_rule():
    fields = [f.name for f in dataclasses.fields(DurableSettings)]
    missing = [name for name in fields if name not in RULES]
    assert not missing, f"add a rule for {missing} to durable.conf.RULES (one line each)"
    assert list(RULES) == fields, "RULES has a key DurableSettings does not (or in another order)"


def test_every_default_obeys_its_rule_and_the_relations():
    defaults = DurableSettings()
    for key, rule in RULES.items():
        assert rule.check(getattr(defaults, key)), f"default of {key} breaks its own rule"
    for rel in RELATIONS:
        assert rel.holds(getattr(defaults, rel.first), getattr(defaults, rel.second)), rel


def test_every_rule_can_say_what_it_accepts():
    for key, rule in RULES.items():
        assert rule.requirement, key
        assert rule.id.startswith("durable.E0"), key
