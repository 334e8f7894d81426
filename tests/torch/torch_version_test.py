"""The package runs only under the torch major.minor it was built for (ctest torch_version_test,
label torch; docs/torch.md "Building"): morph._torch_backend subclasses c10d's classes against
one torch's headers, so `import morph` under another torch must raise an ImportError naming
both versions, not load the extension (an undefined symbol, or a wrong virtual call)."""
import os
import subprocess
import sys
import unittest

import torch

import morph  # noqa: F401  (passes: the torch it was built for)
from morph import _torch_abi


class CheckTest(unittest.TestCase):
    def test_major_minor(self):
        self.assertEqual(_torch_abi.major_minor("2.15.0+cu132"), "2.15")
        self.assertEqual(_torch_abi.major_minor("2.11.0a0+git1234"), "2.11")
        self.assertEqual(_torch_abi.major_minor("2.1"), "2.1")
        with self.assertRaises(ValueError):
            _torch_abi.major_minor("nightly")

    def test_patch_and_local_tag_do_not_matter(self):
        _torch_abi.check("2.11.0+cu130", "2.11.1+cpu")
        _torch_abi.check("2.15.0", "2.15.0+cu132")
        _torch_abi.check(None, "2.15.0")  # built without torch: nothing to check

    def test_another_minor_is_refused_naming_both(self):
        for built, running in (("2.11.0+cu130", "2.15.0+cu132"), ("2.15.0", "2.11.0"),
                               ("2.1.0", "2.11.0"), ("2.15.0", "3.15.0")):
            with self.assertRaises(ImportError) as cm:
                _torch_abi.check(built, running, "/x/torch/__init__.py")
            msg = str(cm.exception)
            self.assertIn(built, msg)
            self.assertIn(running, msg)
            self.assertIn("MORPH_TORCH=" + _torch_abi.major_minor(running), msg)
            self.assertIn("/x/torch/__init__.py", msg)


class BuildTest(unittest.TestCase):
    def test_recorded_version_is_this_torch(self):
        from morph import _torch_build

        built = _torch_abi.major_minor(_torch_build.TORCH_VERSION)
        self.assertEqual(built, _torch_abi.major_minor(torch.__version__))
        asked = os.environ.get("MORPH_TORCH")  # the build folder's MORPH_TORCH (ctest's env)
        if asked:
            self.assertEqual(built, asked)

    def test_import_under_another_torch_raises(self):
        from morph import _torch_build

        major, minor = _torch_abi.major_minor(_torch_build.TORCH_VERSION).split(".")
        other = f"{major}.{int(minor) + 1}.0"
        code = f"""
import sys, torch
torch.__version__ = {other!r}
try:
    import morph
except ImportError as e:
    print("refused:", e)
    sys.exit(3 if "morph._torch_backend" in sys.modules else 0)
sys.exit(1)
"""
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=300)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn("refused:", r.stdout)
        self.assertIn(_torch_build.TORCH_VERSION, r.stdout)
        self.assertIn(other, r.stdout)


if __name__ == "__main__":
    unittest.main(verbosity=2)
