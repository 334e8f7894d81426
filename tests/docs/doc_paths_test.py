#!/usr/bin/env python3
"""Keeps the docs true about the tree: every repository path they name exists, and design.md's
table of folders lists every folder of layering_test's include order, in that order.

Scanned: every Markdown file of the repository (docs/, README.md, examples/*/README.md,
python/README.md) and the comments of every C/C++ header. A token is taken for a repository
path when
  - it starts with a top-level entry of the tree (`runtime/ha/`, `docs/design.md`, `Makefile`),
  - or it contains a slash and ends in a file extension or a slash (`switch/switch.cc`,
    `morph/morph.h`, `shm/`): some path of the tree must end with it,
  - or it is a bare file name with a source or doc extension (`runtime_impl.h`, `STYLE.md`):
    some file of the tree must have that name;
and a Markdown link's target is resolved from its document's folder. `<x>` and `*` are
wildcards, `{a,b}` expands; build outputs (`build/...`), absolute paths and URLs are not
repository paths. Names of other projects' files (torch's, NCCL's) are listed in FOREIGN below.

Usage: doc_paths_test.py [source root]. Exit status 1 lists every stale reference.
"""
import fnmatch
import os
import re
import sys

# Other projects' files and folders that docs or comments name on purpose: a token equal to one
# of these, or starting with one that ends in '/', is not ours.
FOREIGN = {
    # system, CUDA, NCCL, MPI, gtest, DLPack headers and files
    "nccl.h", "nccl_net.h", "mpi.h", "cuda_runtime.h", "dlpack.h", "gtest.h",
    "nccl.h.in", "libnccl.map",
    "param.h",  # NCCL's src/include/param.h
    # other projects' folders cited for comparison (PyTorch, Gloo, Asio)
    "torch/", "gloo/", "c10d/", "tcp/", "asio/", "torchtitan/",
    # an elided prefix: a file of an installed package, as a traceback shows it
    ".../",
    # files morph writes at run time, named where their format is described
    "manifest.json",
}

# Extensions that make a bare name (no slash) a file name worth checking.
EXTENSIONS = {"h", "cc", "cu", "cuh", "hpp", "cpp", "c", "md", "py", "pyi", "sh", "cmake",
              "json", "map", "toml", "txt", "in", "yaml", "yml"}

# Top-level folders that hold build outputs, never repository paths; .gitignore's rooted
# folders (/out/, /.gpu-bundle/) are added to these.
OUTPUTS = {"build", "out"}

TOKEN = re.compile(r"(?:[\w.\-*~+<>]|\{[\w.,\-]*\}|/)+")
MD_LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")


def read_outputs(root):
    """.gitignore's rooted folders ("/out/", "/build*/"): outputs, not sources."""
    try:
        with open(os.path.join(root, ".gitignore"), encoding="utf-8") as f:
            for line in f:
                m = re.match(r"^/([^/*]+)\*?/\s*$", line)
                if m:
                    OUTPUTS.add(m.group(1))
    except OSError:
        pass


def walk(root):
    """Every file and folder of the tree, relative to root, outputs and caches left out."""
    files, dirs = set(), set()
    for here, subdirs, names in os.walk(root):
        rel = os.path.relpath(here, root)
        subdirs[:] = [d for d in subdirs
                      if not (rel == "." and (d.startswith("build") or d in OUTPUTS))
                      and d not in {".git", "__pycache__", ".venv", "venv"}]
        for d in subdirs:
            dirs.add(os.path.normpath(os.path.join(rel, d)))
        for n in names:
            files.add(os.path.normpath(os.path.join(rel, n)))
    return files, dirs


class Tree:
    def __init__(self, root):
        self.files, self.dirs = walk(root)
        self.paths = sorted(self.files | {d + "/" for d in self.dirs})
        self.basenames = {os.path.basename(f) for f in self.files}
        self.top = {p.split("/")[0] for p in self.files | self.dirs}

    def exists(self, path):
        """path relative to the root; may end in '/', may hold wildcards."""
        path = path.rstrip("/") if path not in ("", "/") else path
        if not any(c in path for c in "*?["):
            return path in self.files or path in self.dirs
        return any(fnmatch.fnmatchcase(p.rstrip("/"), path) for p in self.paths)

    def ends_with(self, tail):
        want_dir = tail.endswith("/")
        tail = tail.rstrip("/")
        pool = [d for d in self.dirs] if want_dir else list(self.files | self.dirs)
        return any(fnmatch.fnmatchcase("/" + p, "*/" + tail) for p in pool)

    def has_name(self, name):
        if not any(c in name for c in "*?["):
            return name in self.basenames
        return any(fnmatch.fnmatchcase(b, name) for b in self.basenames)


def expand(token):
    """`a_{x,y}.cc` and `a.h/.cc` -> both files; `<placeholder>` -> `*`."""
    token = re.sub(r"<[^<>/]*>", "*", token)
    m = re.fullmatch(r"(.+)\.(\w+)/\.(\w+)", token)
    if m:
        return [f"{m.group(1)}.{m.group(2)}", f"{m.group(1)}.{m.group(3)}"]
    m = re.search(r"\{([^{}]*)\}", token)
    if not m:
        return [token]
    out = []
    for part in m.group(1).split(","):
        out.extend(expand(token[:m.start()] + part + token[m.end():]))
    return out


def foreign(token):
    return token in FOREIGN or any(
        f.endswith("/") and token.startswith(f) for f in FOREIGN)


def stale(tree, token):
    """Whether token names a repository path that does not exist."""
    if foreign(token):
        return False
    first = token.split("/")[0]
    if first in OUTPUTS or first.startswith("build"):
        return False
    if "/" in token and first in tree.top:
        # A target named after its source (bench/plan_bench) is the source's.
        return not (tree.exists(token) or "." not in token.split("/")[-1]
                    and tree.exists(token + ".*"))
    ext = token.rsplit(".", 1)[1] if "." in token.split("/")[-1] else ""
    has_ext = ext in EXTENSIONS
    if "/" in token:
        if not re.fullmatch(r"[a-z0-9_.\-*/]+", token):
            return False  # ECONNRESET/EPIPE, Foo/Bar: not our file names
        # A file (switch/switch.cc, morph/morph.h) or folders (collectives/shm/); a single
        # folder (lib/, dp/) is too often something else.
        if not (has_ext or token.endswith("/") and token.count("/") > 1):
            return False  # dp/tp/pp, send/recv, host/port
        return not tree.ends_with(token)
    if first in tree.top and tree.exists(first):
        return False  # Makefile, README.md
    if has_ext:
        return not tree.has_name(token)
    return False


def candidates(text):
    """(token, line number) of every path-like token of text."""
    for m in TOKEN.finditer(text):
        raw = m.group(0)
        before = text[m.start() - 1] if m.start() > 0 else ""
        if before in "$:/@=" and before:
            continue  # ${VAR}/x, http://..., x@y, --flag=x
        if raw.endswith("..."):
            continue  # "dp/...": an elision
        tok = raw.rstrip(".,").lstrip(",")
        if tok.startswith("<") and tok.endswith(">") and tok.count("<") == 1:
            tok = tok[1:-1]  # #include <morph/morph.h>
        while tok.startswith("./"):
            tok = tok[2:]
        if not tok or tok.startswith(("/", "~", "-", "<")) or "/" not in tok and "." not in tok:
            continue
        if re.fullmatch(r"\.\w+", tok):
            continue  # a bare extension: ".cu"
        if tok.startswith("../"):
            continue  # relative links are checked as links
        line = text.count("\n", 0, m.start()) + 1
        yield tok, line


def header_comments(source):
    """The comments of a C/C++ source, other characters blanked (newlines kept)."""
    out = []
    i, n = 0, len(source)
    while i < n:
        c = source[i]
        if source.startswith("//", i):
            j = source.find("\n", i)
            j = n if j < 0 else j
            out.append(source[i + 2:j])
            i = j
        elif source.startswith("/*", i):
            j = source.find("*/", i + 2)
            j = n if j < 0 else j
            out.append(source[i + 2:j])
            i = j + 2
        elif c in "\"'":
            j = i + 1
            while j < n and source[j] != c and source[j] != "\n":
                j += 2 if source[j] == "\\" else 1
            out.append(re.sub(r"[^\n]", " ", source[i:j + 1]))
            i = j + 1
        else:
            out.append(c if c == "\n" else " ")
            i += 1
    return "".join(out)


def check_paths(root, tree):
    problems = []
    docs = sorted(f for f in tree.files if f.endswith(".md"))
    headers = sorted(f for f in tree.files if f.endswith((".h", ".hpp", ".cuh")))
    for rel in docs + headers:
        with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as f:
            text = f.read()
        if rel.endswith(".md"):
            for m in MD_LINK.finditer(text):
                target = m.group(1)
                if "://" in target or target.startswith("mailto:"):
                    continue
                path = os.path.normpath(os.path.join(os.path.dirname(rel), target))
                if not tree.exists(path):
                    line = text.count("\n", 0, m.start()) + 1
                    problems.append(f"{rel}:{line}: link to {target}: no {path}")
        else:
            text = header_comments(text)
        seen = set()
        for tok, line in candidates(text):
            for variant in expand(tok):
                if (variant, line) in seen:
                    continue
                if stale(tree, variant):
                    seen.add((variant, line))
                    problems.append(f"{rel}:{line}: {variant}: no such path in the tree")
    return problems


def check_folders(root):
    """Every folder of layering_test's order is a row of design.md's table of folders, in order."""
    problems = []
    with open(os.path.join(root, "runtime/layering_test.cc"), encoding="utf-8") as f:
        src = f.read()
    m = re.search(r"kOrder\s*=\s*\{(.*?)\};", src, re.S)
    if not m:
        return ["runtime/layering_test.cc: no kOrder found"]
    order = ["include/morph/" if x == "morph" else x + "/"
             for x in re.findall(r'"([^"]+)"', m.group(1))]
    with open(os.path.join(root, "docs/design.md"), encoding="utf-8") as f:
        lines = f.read().split("\n")
    rows, in_table = [], False
    for line in lines:
        if re.match(r"^\|\s*folder\s*\|", line):
            in_table = True
            continue
        if in_table:
            if not line.startswith("|"):
                break
            cell = line.split("|")[1].strip().strip("`")
            if cell and not set(cell) <= set("-: "):
                rows.append(cell if cell.endswith("/") else cell + "/")
    if not rows:
        return ["docs/design.md: no table of folders (a table whose first column is 'folder')"]
    for folder in order:
        if folder not in rows:
            problems.append(f"docs/design.md: table of folders lacks {folder} "
                            "(runtime/layering_test.cc's kOrder has it)")
    listed = [r for r in rows if r in order]
    if listed != [o for o in order if o in listed]:
        problems.append("docs/design.md: table of folders is not in layering_test's order: "
                        + ", ".join(listed) + " against " + ", ".join(order))
    return problems


def self_check(tree):
    """The detector itself: a stale name is caught, a right one passes (else a broken pattern
    would pass every document)."""
    wrong = [t for t, want in [
        ("runtime/api/runtime_impl.h", False), ("runtime/api/no_such_file.cc", True),
        ("api/runtime_impl.h", False), ("api/no_such_file.h", True),
        ("runtime_impl.h", False), ("NO_SUCH.md", True), ("runtime/*/runtime_impl.h", False),
        ("morph/morph.h", False), ("build/reshard/morph-plan", False), ("dp/tp/pp", False),
        ("include/morph/<name>.h", False), ("runtime/no_such_folder/", True)]
        if any(stale(tree, v) for v in expand(t)) != want]
    return [f"doc_paths_test.py: misjudged {t}" for t in wrong]


def main():
    root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else
                           os.path.join(os.path.dirname(__file__), "..", ".."))
    read_outputs(root)
    tree = Tree(root)
    problems = self_check(tree) + check_paths(root, tree) + check_folders(root)
    for p in problems:
        print(p)
    if problems:
        print(f"{len(problems)} stale reference(s)", file=sys.stderr)
        return 1
    print("every path named in the docs and header comments exists")
    return 0


if __name__ == "__main__":
    sys.exit(main())
