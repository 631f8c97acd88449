"""Run outputs: results.json, then one section per phase (rows, CSV, plot, console table).

- :mod:`~edgefuse.results.recorder`: the generic :class:`RunRecorder` (rounds, a phase's
  keys via :meth:`RunRecorder.update`, summary, status), :func:`load_results`, the
  private-text scrubber, :func:`write_outputs` and :func:`print_summary`, which go through
  :data:`SECTIONS` and name no phase. The results.json schema is documented there.
- :mod:`~edgefuse.results.section`: the :class:`Section` shape and shared cell helpers.
- :mod:`~edgefuse.results.plotting`: matplotlib helpers, the only matplotlib importer
  (lazily, so importing this package does not load matplotlib).
- One module per section, each owning its file names, columns, CSV text, plots and table:
  :mod:`~edgefuse.results.training` (rounds: results.csv, eval_loss.png, bytes.png),
  :mod:`~edgefuse.results.c2c`, :mod:`~edgefuse.results.decoding`,
  :mod:`~edgefuse.results.privacy`.

**Adding a phase's results = one new module here (its columns, ``csv_text``, plots,
``table`` and a ``SECTION = Section(...)``) + one line in**
:data:`edgefuse.results.sections.SECTIONS`. The phase records its rows with
``recorder.update({key: rows, ...})``, keys as in ``SECTION.keys``; nothing else changes.
"""

from edgefuse.results.recorder import (  # noqa: F401
    FINAL_STATUSES, JSON_NAME, RUN_STATUSES, TEXT_FIELDS, RunRecorder, load_results, print_summary,
    redact_results, scrub_text, write_json_csv, write_outputs,
)
from edgefuse.results.section import MB, Plot, Section  # noqa: F401
from edgefuse.results.sections import SECTIONS  # noqa: F401

# The sections' own names, importable from the package as before the split.
from edgefuse.results.training import (  # noqa: F401,E402
    BYTES_PNG_NAME, CSV_COLUMNS, CSV_NAME, EVAL_PNG_NAME, console_table, csv_text, plot_bytes, plot_eval_loss,
)
from edgefuse.results.c2c import (  # noqa: F401,E402
    C2C_COLUMNS, C2C_CSV_NAME, C2C_MODE_ORDER, C2C_PNG_NAME, c2c_csv_text, c2c_label, c2c_table, plot_c2c,
)
from edgefuse.results.decoding import (  # noqa: F401,E402
    DECODING_CSV_NAME, DECODING_PNG_NAME, decoding_csv_text, decoding_table, plot_decoding,
)
from edgefuse.results.privacy import (  # noqa: F401,E402
    PRIVACY_CSV_NAME, PRIVACY_FIELDS, PRIVACY_PNG_NAME, plot_privacy, privacy_csv_text, privacy_table,
)
