"""A vLLM engine on attnx's backend whose every layer call is checked as it runs, for the
quantised-KV tests of tests/integrations/test_vllm.py:

    python tests/integrations/_vllm_checked_child.py JOB.json OUT.json

JOB and OUT are those of attnx.bench._vllm's child; OUT also gets "checks": the number of calls,
whether every new key and value row was stored as attnx.quant stores it (codes, and the scale
where one is stored per row, bit for bit), and the largest difference between a call's output
and attnx's paged attention over its pages read back in float32 (with integer queries over int8
pages, over its query read back too, as ``attnx.quant.quantize_query`` quantises it). (Greedy
tokens alone cannot show this: with quantised KV they move with rounding-level differences,
bench/NOTES.md.)
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np


def main(job_path: str, out_path: str) -> None:
    import attnx
    from attnx import quant
    from attnx.bench import _vllm as bench_vllm
    from attnx.integrations import _vllm, tensors

    checks = {"calls": 0, "rows_equal": True, "max_abs_diff": 0.0}
    attend = _vllm.attend
    as_numpy = tensors.to_numpy

    def checked(query, key, value, pages, batch, output, **kw):
        attend(query, key, value, pages, batch, output, **kw)
        t, bs = batch.slots.shape[0], pages.k.shape[2]
        at = (batch.slots // bs, slice(None), batch.slots % bs)
        sides = ((key, pages.k, pages.k_scales), (value, pages.v, pages.v_scales))
        for new, codes, scales in sides if kw.get("write", True) else ():
            rows = as_numpy(new[:t], "new")
            if isinstance(scales, float):  # one scale per layer: only the codes are stored
                same = np.array_equal(
                    codes[at].view(np.uint8),
                    quant.quantize_kv(rows, codes.dtype, scale=scales)[0].view(np.uint8),
                )
            else:
                want = quant.quantize_kv(rows, codes.dtype)
                same = np.array_equal(codes[at], want[0]) and np.array_equal(
                    scales[at], want[1], equal_nan=True
                )
            checks["rows_equal"] &= same
        # the batch's blocks read back in float32, and the same call over them
        used = np.unique(batch.block_tables)
        blocks = [p[used] if isinstance(p, np.ndarray) else p for p in pages]
        floats = _vllm.Pages(*quant.dequantised_pages(*blocks))
        local = replace(batch, block_tables=np.searchsorted(used, batch.block_tables))
        again = np.zeros((t, *output.shape[1:]), np.float32)
        if pages.k.dtype == np.int8 and attnx.int8_query():  # integer queries: read back too
            q = quant.quantize_query(as_numpy(query[:t], "query"), kw.get("scale"))
            query, kw = q.astype(np.float32), {**kw, "scale": 1.0}
        attend(query, key, value, floats, local, again, **{**kw, "write": False})
        diff = float(np.abs(again - as_numpy(output[:t], "output")).max())
        checks["max_abs_diff"] = max(checks["max_abs_diff"], diff)
        checks["calls"] += 1

    _vllm.attend = checked
    bench_vllm.child(job_path, out_path)
    out = json.loads(Path(out_path).read_text())
    out["checks"] = {k: (bool(v) if k == "rows_equal" else v) for k, v in checks.items()}
    Path(out_path).write_text(json.dumps(out))


if __name__ == "__main__":
    main(*sys.argv[1:3])
