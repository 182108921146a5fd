import sys

from experiments.plots.cli import main

raise SystemExit(main(sys.argv[1:]))
