"""`python -m txactors.cli …`: the `txactors` command without its installed script."""

from txactors.cli import main

if __name__ == "__main__":
    main()
