from ultratron.cli import entry

entry()
