"""``python -m chaos``: see :mod:`chaos.run`."""

from chaos.run import main

main()
