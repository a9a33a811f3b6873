# With JLOG_DIR set: every cache-miss compile that JAX writes to the persistent cache is logged
# (pid, current pytest test, module name, cache key, compile seconds) to JLOG_DIR/<pid>.jsonl.
import os, sys, json, time
_dir = os.environ.get("JLOG_DIR")
if _dir:
    import importlib.abc, importlib.util
    os.makedirs(_dir, exist_ok=True)
    class _Hook(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != "jax._src.compilation_cache":
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            orig_exec = spec.loader.exec_module
            def exec_module(module):
                orig_exec(module)
                put = module.put_executable_and_time
                def wrapped(cache_key, module_name, executable, backend, compile_time, *a, **k):
                    with open(os.path.join(_dir, f"{os.getpid()}.jsonl"), "a") as f:
                        f.write(json.dumps({"pid": os.getpid(), "test": os.environ.get("PYTEST_CURRENT_TEST", ""),
                                            "argv": " ".join(sys.argv)[:200], "module": module_name,
                                            "key": cache_key, "secs": compile_time, "t": time.time()}) + "\n")
                    return put(cache_key, module_name, executable, backend, compile_time, *a, **k)
                module.put_executable_and_time = wrapped
            spec.loader.exec_module = exec_module
            return spec
    sys.meta_path.insert(0, _Hook())
