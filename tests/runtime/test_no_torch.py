"""The runtime half never imports torch or transformers, not even lazily."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

BLOCKER = textwrap.dedent("""
    import importlib.abc, sys

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("torch", "transformers"):
                raise ImportError(f"{name} is blocked: the runtime must not import it")
            return None

    sys.meta_path.insert(0, Block())
""")


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCKER + textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=300)


def test_blocker_blocks():
    r = _run("import torch")
    assert r.returncode != 0 and "blocked" in r.stderr


def test_generate_without_torch(tiny_bundle):
    r = _run(f"""
        import json, sys
        from specedge.runtime import Generator
        gen = Generator.from_bundle({str(tiny_bundle)!r})
        out = gen.generate("hello", max_new_tokens=20, draft_tokens=3)
        sampled = gen.generate("hello", max_new_tokens=20, temperature=0.8, top_p=0.9)
        lookup = gen.generate("hello", max_new_tokens=20, drafter="prompt-lookup")
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers"))
        print(json.dumps({{"n": len(out.token_ids), "m": len(sampled.token_ids),
                          "l": len(lookup.token_ids), "loaded": loaded}}))
    """)
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["n"] > 0 and result["m"] > 0 and result["l"] > 0
    assert result["loaded"] == []


def test_cli_generate_without_torch(tiny_bundle):
    r = _run(f"""
        import sys
        from specedge.cli import main
        sys.argv = ["specedge", "generate", "--bundle", {str(tiny_bundle)!r},
                    "--prompt", "hi", "--max-new-tokens", "8", "--json"]
        main()
    """)
    assert r.returncode == 0, r.stderr
    assert "token_ids" in r.stdout


# `specedge build` runs on the device, where torch is not installed: the build modules count
# as runtime here. (Also no onnx: the device need not have it.)
TORCH_FREE_BUILD = ["specedge.runtime.backends.engine_manifest",
                    "specedge.runtime.backends.gpu_info", "specedge.export.tensorrt.plan",
                    "specedge.export.tensorrt.build", "specedge.export.tensorrt.engine_calls",
                    "specedge.export.cli"]


def test_build_modules_without_torch():
    r = _run(f"""
        import importlib, json, sys
        for name in {TORCH_FREE_BUILD!r}:
            importlib.import_module(name)
        loaded = sorted(m for m in sys.modules
                        if m.split(".")[0] in ("torch", "transformers", "onnx", "tensorrt"))
        print(json.dumps(loaded))
    """)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1]) == []


def test_cli_build_without_torch(tiny_bundle):
    """Without TensorRT it stops with the pip hint, and never reaches for torch."""
    r = _run(f"""
        import sys
        sys.modules["tensorrt"] = None  # as on a machine without TensorRT
        from specedge.cli import main
        sys.argv = ["specedge", "build", "--bundle", {str(tiny_bundle)!r}]
        main()
    """)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == ("specedge: error: TensorRT is not installed: pip install "
                                "tensorrt (on Jetson it comes with JetPack); the ort-cpu "
                                "backend works without it")


def test_server_answers_without_torch(tiny_bundle):
    """`specedge serve`'s app, driven in process through Starlette's test client."""
    r = _run(f"""
        import json, sys
        from starlette.testclient import TestClient
        from specedge.serve.app import ServerSettings, build_app
        import time
        app = build_app(ServerSettings(bundle={str(tiny_bundle)!r}, threads=1))
        with TestClient(app, base_url="http://127.0.0.1") as client:  # a Host the app answers
            for _ in range(1200):  # a minute at most
                if client.get("/health").status_code == 200:
                    break
                time.sleep(0.05)
            reply = client.post("/v1/completions", json={{"prompt": "hello",
                                "max_tokens": 8, "temperature": 0}}).json()
        loaded = sorted(m for m in sys.modules
                        if m.split(".")[0] in ("torch", "transformers", "onnx"))
        print(json.dumps({{"usage": reply["usage"], "loaded": loaded}}))
    """)
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["usage"]["completion_tokens"] > 0
    assert result["loaded"] == []
