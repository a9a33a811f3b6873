# With JLOG_DIR set: every cache-miss compile that JAX writes to the persistent cache is logged
# (pid, current pytest test, module name, cache key, compile seconds) to JLOG_DIR/<pid>.jsonl.
import json
import os
import sys
import time

_dir = os.environ.get("JLOG_DIR")
if _dir:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tools/suite_profile
    from import_hook import after_import

    os.makedirs(_dir, exist_ok=True)

    def _patch(module):
        put = module.put_executable_and_time

        def wrapped(cache_key, module_name, executable, backend, compile_time, *a, **k):
            with open(os.path.join(_dir, f"{os.getpid()}.jsonl"), "a") as f:
                f.write(json.dumps({"pid": os.getpid(), "test": os.environ.get("PYTEST_CURRENT_TEST", ""),
                                    "argv": " ".join(sys.argv)[:200], "module": module_name,
                                    "key": cache_key, "secs": compile_time, "t": time.time()}) + "\n")
            return put(cache_key, module_name, executable, backend, compile_time, *a, **k)

        module.put_executable_and_time = wrapped

    after_import("jax._src.compilation_cache", _patch)
