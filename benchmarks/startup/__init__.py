"""Start-up: what ``import gradfleet`` and the CLI commands that do not train cost
(``import_time``).  Results: docs/speed.md."""
