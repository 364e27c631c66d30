"""The value types of our command-line flags (argparse's `type=`), and a parser whose errors
are one line.

Every count and number a flag takes is checked over its whole range, zero included: a value
that cannot be meant (`--jobs 0`, `--seq-len -1`, `--limit nan`) is refused by name, never
replaced by a default. A flag whose absence means "the default" has the default None, so
that no value typed by hand can stand for it.
"""

from __future__ import annotations

import argparse
import math


class StoreOnce(argparse._StoreAction):
    """argparse's "store", refusing a flag given twice: argparse keeps the last value
    silently (`tokenizer train --input a.jsonl --input b.jsonl` trained on b alone). A flag
    meant to take several values says so (`action="append"`, `nargs`)."""

    def __call__(self, parser, namespace, values, option_string=None):
        given = parser.given_once
        if self.dest in given:
            parser.error(f"argument {'/'.join(self.option_strings)}: given twice ({given[self.dest]}, then "
                         f"{option_string} {values}): give it once")
        given[self.dest] = f"{option_string} {values}"
        super().__call__(parser, namespace, values, option_string)


class Parser(argparse.ArgumentParser):
    """argparse, with its error on one line (`error: argument --jobs: 0: must be an integer
    >= 1`) and exit code 2, as the config checks report theirs; a single-valued flag given
    twice is an error (StoreOnce). Sub-commands' parsers are Parsers too."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register("action", None, StoreOnce)
        self.register("action", "store", StoreOnce)
        self.given_once: dict[str, str] = {}

    def parse_known_args(self, args=None, namespace=None):
        self.given_once = {}
        return super().parse_known_args(args, namespace)

    def error(self, message: str):
        self.exit(2, f"error: {message}\n")


def count(low: int = 1):
    """An integer >= low."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: must be an integer >= {low}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value}: must be an integer >= {low}")
        return value

    parse.__name__ = f"an integer >= {low}"
    return parse


def number(low: float = 0.0, high: float | None = None, *, low_open: bool = True, high_open: bool = False):
    """A finite number above low (or at it, if not low_open), and up to high where given."""
    shown = (f"a number {'>' if low_open else '>='} {low:g}" if high is None else
             f"a number in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}")

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        above = value > low if low_open else value >= low
        below = high is None or (value < high if high_open else value <= high)
        if not (math.isfinite(value) and above and below):
            raise argparse.ArgumentTypeError(f"{text}: must be {shown}")
        return value

    parse.__name__ = shown
    return parse


def seed_list(text: str) -> list[int]:
    """Comma-separated distinct integers >= 0 (0 is a seed like any other)."""
    try:
        seeds = [int(x) for x in text.split(",")]
    except ValueError:
        seeds = []
    if not seeds or len(set(seeds)) != len(seeds) or min(seeds) < 0:
        raise argparse.ArgumentTypeError(f"{text}: must be comma-separated distinct integers >= 0, e.g. 0,1,2")
    return seeds
