"""An app whose ``crons`` module declares a bad schedule: what ``manage.py check`` sees.

Installed only by tests/integration/test_cron.py, for the length of one test.
"""
