"""What bench's plot scripts share: a JSON file in, a PNG out, and matplotlib without a display
(a clear message when it is missing)."""
import argparse
import sys


def json_to_png(doc, tool):
    """Parses `json -o PNG` and returns (args, pyplot)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json")
    ap.add_argument("-o", "--output", required=True)
    args = ap.parse_args()
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit(f"{tool}: needs matplotlib: apt-get install python3-matplotlib (`make deps` installs it)")
    return args, plt
