"""``python -m gradfleet``: the same command as the ``gradfleet`` console script."""

from gradfleet.cli.main import main

if __name__ == "__main__":  # spawned workers re-import this module; only the real run starts
    main()
