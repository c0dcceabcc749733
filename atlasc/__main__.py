"""`python -m atlasc`: the same command line as the `atlasc` console script."""

from atlasc.cli import main

if __name__ == "__main__":
    main()
