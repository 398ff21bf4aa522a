"""Dispatch: what firing a timer calls (handler registry, fire context, brokers)."""
