"""after_import(name, patch): call patch(module) right after `name` is first imported, for the
sitecustomize hooks in compile_log/ and compile_cpu/ (they load before JAX, which they patch).
The one definition is the test session's own (tests/subprocess_site/sitecustomize.py), loaded by
path under another module name, so its hook is not installed twice."""
import importlib.util
import os

_SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "subprocess_site",
                     "sitecustomize.py")
_spec = importlib.util.spec_from_file_location("replay_tests_subprocess_site", _SITE)
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)
after_import = _module.after_import
