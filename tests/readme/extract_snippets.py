#!/usr/bin/env python3
"""Writes the snippets of the README and docs/ out as source files, so that ctest builds and runs
them as written.

  extract_snippets.py OUTDIR NAME... --from PAGE.md...

A snippet is a ```cpp (NAME.cpp) or ```python (NAME.py) block right after a line
`<!-- snippet NAME [options] -->`. Each NAME asked for must be in exactly one of the pages, once
(the build fails naming it otherwise), and every snippet in the pages must be asked for: a snippet
nobody compiles is a snippet that rots. A file is rewritten only when its text changed, so editing
the prose rebuilds nothing.
"""
import os
import re
import sys

PATTERN = re.compile(r"^<!-- snippet (\S+)[^>]*-->\n```(cpp|python)\n(.*?)^```", re.S | re.M)
EXTENSION = {"cpp": (".cpp", "//"), "python": (".py", "#")}


def main():
    args = sys.argv[1:]
    if "--from" not in args:
        sys.exit("usage: extract_snippets.py OUTDIR NAME... --from PAGE.md...")
    cut = args.index("--from")
    outdir, wanted, pages = args[0], args[1:cut], args[cut + 1:]
    found = {}
    for page in pages:
        with open(page) as f:
            for m in PATTERN.finditer(f.read()):
                if m.group(1) in found:
                    sys.exit(f"{page}: snippet '{m.group(1)}' appears twice (also in {found[m.group(1)][2]})")
                found[m.group(1)] = (m.group(2), m.group(3), page)
    missing = [n for n in wanted if n not in found]
    extra = [n for n in found if n not in wanted]
    if missing or extra:
        sys.exit(f"{', '.join(pages)}: snippets missing: {missing or 'none'}; not built by tests/CMakeLists.txt: {extra or 'none'}")
    os.makedirs(outdir, exist_ok=True)
    for name in wanted:
        lang, body, page = found[name]
        ext, comment = EXTENSION[lang]
        path = os.path.join(outdir, name + ext)
        rel = os.path.relpath(page, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        text = f"{comment} Extracted from {rel} by tests/readme/extract_snippets.py: edit the page, not this file.\n" + body
        if not os.path.exists(path) or open(path).read() != text:
            with open(path, "w") as f:
                f.write(text)


if __name__ == "__main__":
    main()
