# With CPROF_DIR set: every jax._src.compiler.compile_or_get_cached call (a persistent-cache hit or a
# compile) is logged to CPROF_DIR/<pid>.jsonl with its module name, the pytest test (PYTEST_CURRENT_TEST,
# inherited by subprocesses), the call's process CPU and wall seconds, and those of the XLA compile
# inside it (backend_compile_and_load: 0 on a hit). Unlike compile_log/ (JAX's own whole seconds, misses
# only) it times small compiles too. CPROF_STACK=jit_slice,jit_add adds the last repository frames that
# caused those modules' compiles. Reaches only processes whose PYTHONPATH holds this folder.
import json
import os
import sys
import time

_dir = os.environ.get("CPROF_DIR")
if _dir:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tools/suite_profile
    from import_hook import after_import

    os.makedirs(_dir, exist_ok=True)

    def _patch(module):
        cached, compile_ = module.compile_or_get_cached, module.backend_compile_and_load
        inner = {"cpu": 0.0, "wall": 0.0}

        def timed_compile(*a, **k):
            c0, w0 = time.process_time(), time.time()
            try:
                return compile_(*a, **k)
            finally:
                inner["cpu"] += time.process_time() - c0
                inner["wall"] += time.time() - w0

        def timed_cached(backend, computation, *a, **k):
            c0, w0 = time.process_time(), time.time()
            inner["cpu"] = inner["wall"] = 0.0
            try:
                return cached(backend, computation, *a, **k)
            finally:
                try:
                    name = str(computation.operation.attributes["sym_name"]).strip('"')
                except Exception:
                    name = "?"
                rec = {"pid": os.getpid(), "test": os.environ.get("PYTEST_CURRENT_TEST", "")[:200],
                       "argv": " ".join(sys.argv)[:120], "module": name,
                       "cpu": time.process_time() - c0, "wall": time.time() - w0,
                       "compile_cpu": inner["cpu"], "compile_wall": inner["wall"]}
                if inner["cpu"] and name in os.environ.get("CPROF_STACK", "").split(","):
                    import traceback
                    root = os.getcwd() + "/"
                    rec["stack"] = [f"{f.filename.replace(root, '')}:{f.lineno} {f.name}" for f in traceback.extract_stack()
                                    if "site-packages" not in f.filename and f.filename != __file__][-6:]
                with open(os.path.join(_dir, f"{os.getpid()}.jsonl"), "a") as f:
                    f.write(json.dumps(rec) + "\n")

        module.compile_or_get_cached = timed_cached
        module.backend_compile_and_load = timed_compile

    after_import("jax._src.compiler", _patch)
