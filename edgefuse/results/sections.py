"""The sections of a run's outputs, in the order they are written and printed.

Adding a phase's results: one new module beside these (rows, CSV, plot, table, and a
``SECTION`` built with :class:`~edgefuse.results.section.Section`) and one line here.
"""

from __future__ import annotations

from edgefuse.results import c2c, decoding, privacy, training
from edgefuse.results.section import Section

SECTIONS: tuple[Section, ...] = (
    training.SECTION,
    c2c.SECTION,
    decoding.SECTION,
    privacy.SECTION,
)
