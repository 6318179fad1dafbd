"""Read files with MindSpore itself and dump what it sees as JSON (run with MindSpore's Python).

Used by tests/test_mindspore_oracle.py, which runs it with the interpreter named by
``VCGA_MINDSPORE_PYTHON``; it imports no VCGA code. Usage::

    python tests/mindspore_oracle.py JOBS.json OUT.json

``JOBS.json`` is a list of ``{"kind": "mindrecord", "path": ...}`` (read with ``FileReader``) and
``{"kind": "ckpt", "path": ..., "crc_check": bool}`` (read with ``load_checkpoint``). Bytes and arrays
are dumped base64-encoded with their numpy dtype and shape.
"""

from __future__ import annotations

import base64
import json
import os
import sys

os.environ.setdefault("GLOG_v", "3")  # keep MindSpore's logging quiet


def _encode(value):
    import numpy as np

    if isinstance(value, bytes):
        return {"bytes": base64.b64encode(value).decode()}
    if isinstance(value, np.ndarray):
        return {"array": str(value.dtype), "shape": list(value.shape),
                "b64": base64.b64encode(np.ascontiguousarray(value).tobytes()).decode()}
    if isinstance(value, np.generic):
        return value.item()
    return value


def read_mindrecord(path):
    from mindspore.mindrecord import FileReader

    reader = FileReader(path)
    try:
        return {"rows": [{k: _encode(v) for k, v in row.items()} for row in reader.get_next()]}
    finally:
        reader.close()


def read_ckpt(path, crc_check):
    import mindspore as ms

    out = {}
    for name, value in ms.load_checkpoint(path, crc_check=crc_check).items():
        if isinstance(value, str):
            out[name] = {"str": value}
        else:
            arr = value.asnumpy()
            out[name] = {"dtype": str(value.dtype), "shape": list(value.shape),
                         "b64": base64.b64encode(arr.tobytes()).decode()}
    return {"params": out}


def main(argv):
    with open(argv[1]) as f:
        jobs = json.load(f)
    results = []
    for job in jobs:
        if job["kind"] == "mindrecord":
            results.append(read_mindrecord(job["path"]))
        else:
            results.append(read_ckpt(job["path"], job.get("crc_check", False)))
    import mindspore

    with open(argv[2], "w") as f:
        json.dump({"mindspore": mindspore.__version__, "results": results}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
