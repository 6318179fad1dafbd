"""``python -m vcga`` is the ``vcga`` command."""

from vcga.cli import main

if __name__ == "__main__":
    main()
