"""after_import(name, patch): call patch(module) right after `name` is first imported, for the
sitecustomize hooks in compile_log/ and compile_cpu/ (they load before JAX, which they patch)."""
import importlib.abc
import importlib.util
import sys


def after_import(name, patch):
    class _Hook(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):
            if fullname != name:
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(fullname)
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                patch(module)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _Hook())
