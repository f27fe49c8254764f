"""The pin's record: which upstream ggml this fork is built on and how its trees are verified (data only:
hotggml.pin materializes and checks it with git; the binding reads the commit without importing git)."""

TAG = "v0.15.3"
UPSTREAM_COMMIT = "eced84c86f8b012c752c016f7fe789adea168e1e"
TREES = {
    "src": "415371feadc9f45b16a3edccfefca3ef6a2bcbf9",
    "include": "677d7564fb4d2684f8636199b703c5b1605d6bc6",
    "cmake": "ec954fa0a2ab3d466bd16114b71b846b6093c6c8",
    "tests": "150f9ecd0f73d06a70f66b171bf8b2ffc98bd561",
    "CMakeLists.txt": "0ec62a3773d6024fd7d5c849af65aab04cd10583",
}

SDIST_REQUIREMENT = "ggml-python==0.0.45"
SDIST_FILE = "ggml_python-0.0.45.tar.gz"
SDIST_SHA256 = "10aac52075cf3c7ef2b00d6c35b1c23f7b018dbeff8ae8df67339b4be1166f05"
SDIST_PREFIX = "ggml_python-0.0.45/vendor/ggml/"
SDIST_ENV = "HOTGGML_GGML_SDIST"

# The commit fetch() makes from the sdist (fixed identity, date, message): the same
# everywhere. A pin from an initialized submodule is UPSTREAM_COMMIT instead.
SDIST_PIN_COMMIT = "5ae48ca012b48cc80be742a195374919b4abd744"
