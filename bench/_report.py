"""Shared output of the benchmarks: one JSON line (``--json``) or an aligned table."""

import json


def emit(out: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(out))
    else:
        for key, value in out.items():
            print(f"{key:>28}: {value}")
