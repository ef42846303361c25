"""What an installed segflow says about its kernels, comparable across installs.

Run as a script (``python wheel_probe.py MODEL...``) it prints a JSON object; imported,
:func:`kernel_facts` gives the same for the process it runs in. Paths and timings,
which legitimately differ between two installs, are replaced by placeholders.
"""

from __future__ import annotations

import json
import re
import sys

# (pattern, placeholder): where the library came from, and how long anything took.
_VARYING = ((re.compile(r"built in [\d.]+ s into \S+?(?=[);]|$)|loaded from \S+?(?=[);]|$)"),
             "<library>"),
            (re.compile(r"\d+(\.\d+)? (ms|s)\b"), "<time>"))


def normalized(line: str) -> str:
    for pattern, placeholder in _VARYING:
        line = pattern.sub(placeholder, line)
    return line


def kernel_facts(names: list[str]) -> dict[str, object]:
    """Per model: the kernel report after one run on its example inputs; and the native
    library's facts as the CPU target sees them."""
    import segflow
    from segflow import models

    facts: dict[str, object] = {}
    for name in names:
        sess = segflow.InferenceSession(models.build(name), device="cpu")
        sess.run(None, models.example_inputs(name))
        facts[name] = [normalized(line) for line in sess.kernel_report()]
    target = sess.target
    facts["native"] = [target.native is not None, target.native_why, target.native_panel_width,
                       target.native_vector_floats, target.native_fma]
    facts["libdnnl"] = target.dnnl is not None
    return facts


if __name__ == "__main__":
    import segflow

    print(json.dumps({"segflow": segflow.__file__, "path": sys.path,
                      "facts": kernel_facts(sys.argv[1:])}))
