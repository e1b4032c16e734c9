"""``python -m tessera``: the same command line as the ``tessera`` script."""

from tessera.cli import main

if __name__ == "__main__":
    main()
