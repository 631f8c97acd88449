"""Run outputs: the recorder, results.json / CSV / PNG per section, the console summary."""

from edgefuse.results.recorder import *  # noqa: F401,F403
from edgefuse.results.recorder import (  # noqa: F401
    RunRecorder, load_results, print_summary, redact_results, scrub_text, write_outputs,
)
