"""Frozen values built at the speed of a plain class.

A frozen attrs class refuses attribute stores, so attrs's own ``__init__``
stores each field through ``object.__setattr__``: a type lookup and a
descriptor call per field. The values built once per replicated row (RDATA,
POSITION, the events stream's rows) are built another way instead: the
frozen class derives from a plain class that declares the same slots, the
value is filled in as an instance of that writable base (plain slot stores,
which the interpreter specialises), and then becomes an instance of the
frozen class by assigning its ``__class__``. attrs reuses the base's slots,
so the two classes share one layout; :func:`check_layout` makes sure of it
at import, where a layout that differed would fail the first assignment.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations


def check_layout(frozen: type, fields: type) -> None:
    """``frozen`` derives directly from ``fields`` and adds no slot, so a value may change between them.

    Raises:
        TypeError: it adds slots (or does not derive from ``fields``).
    """
    if frozen.__dict__.get("__slots__", ()) != () or frozen.__mro__[1] is not fields:
        raise TypeError(f"{frozen.__name__} must keep the slots of {fields.__name__} and add none")
