"""Link rates as tc(8) writes them (``20mbit``, ``1gbit``, ``100mbps``), parsed to bits per second.

Shared by the heterogeneity specs (``link-rate``) and the network-namespace links that apply them.
"""

from __future__ import annotations

import re

# Multipliers to bits per second.  "bps" units are bytes per second, as in tc(8).
_SI = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_IEC = {"ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
_RATE_UNITS: dict[str, int] = {}
for _prefix, _mult in {**_SI, **_IEC}.items():
    _RATE_UNITS[f"{_prefix}bit"] = _mult
    _RATE_UNITS[f"{_prefix}bps"] = _mult * 8
_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$")


def parse_rate(text: str) -> int:
    """Parse a tc-style rate (``20mbit``, ``1gbit``, ``500kbit``, ``100mbps``) into bits/s.

    ``bit`` units are bits per second, ``bps`` units bytes per second; SI prefixes
    (k, m, g, t) are powers of 1000, IEC prefixes (ki, mi, gi, ti) powers of 1024.
    A bare number means bits per second.
    """
    if not isinstance(text, str):
        raise ValueError(f"invalid link-rate {text!r}: expected a string such as '20mbit'")
    match = _RATE_RE.match(text.lower())
    if match is None or (match.group(2) and match.group(2) not in _RATE_UNITS):
        raise ValueError(
            f"invalid link-rate {text!r}: expected a number with a unit such as "
            "'500kbit', '20mbit', '1gbit' (bits/s) or '100mbps' (bytes/s)"
        )
    number, unit = match.groups()
    bits = round(float(number) * _RATE_UNITS.get(unit, 1))
    if bits <= 0:
        raise ValueError(f"invalid link-rate {text!r}: the rate must be positive")
    return bits
