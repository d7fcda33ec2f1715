"""A training script turned plug-in that still parses the command line when imported: argparse
prints its usage and exits (tests/runtime/test_plugins.py)."""
import argparse

parser = argparse.ArgumentParser(prog="train.py")
parser.add_argument("--data", required=True)
args = parser.parse_args([])


def build():
    raise AssertionError("never reached: the import exits")
