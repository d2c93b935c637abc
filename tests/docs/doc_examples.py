#!/usr/bin/python3
"""The C++ examples of README.md and docs/*.md, kept honest.

Every ```cpp block must be preceded, on the line right above its fence, by one of:

  <!-- example: program NAME, ranks 2 4, prints "TEXT" -->
      a complete program: extracted as NAME.cpp, built against weft::weft and run on each rank
      count; it must print TEXT, which must also appear in the document's text after the block
      (the claim a reader sees is the one the test checks).
  <!-- example: fragment of examples/snippets/FILE.cpp -->
      a fragment of a complete program in examples/snippets/, which is built and run by the
      tests: the fragment's lines appear in FILE.cpp in order, compared without leading and
      trailing spaces. Consecutive lines must be consecutive there too, except across a blank
      line or a line that starts with "...", where FILE.cpp may have more lines; a "..." inside a
      line stands for any text within that line.

usage:
  doc_examples.py check ROOT               every block marked, every fragment found (the ctest)
  doc_examples.py extract ROOT OUTDIR      writes the complete programs (only files that changed)
                                           and prints one line per program: NAME|RANKS|TEXT
  doc_examples.py run TEXT COMMAND...      runs a program: it must exit 0 and print TEXT
"""

import os
import re
import sys

MARKER = re.compile(r"^<!-- example: (.*) -->\s*$")
PROGRAM = re.compile(r'^program ([A-Za-z0-9_]+), ranks ((?:\d+ ?)+), prints "([^";|]+)"$')
FRAGMENT = re.compile(r"^fragment of (examples/snippets/[A-Za-z0-9_]+\.cpp)$")
FENCE = re.compile(r"^```(cpp|c\+\+)\s*$")


def documents(root):
    names = ["README.md"] + sorted("docs/" + n for n in os.listdir(os.path.join(root, "docs")) if n.endswith(".md"))
    return [(n, os.path.join(root, n)) for n in names]


def blocks(path):
    """(line number of the fence, marker text or None, code lines, lines after the block)."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    i = 0
    while i < len(lines):
        if FENCE.match(lines[i]):
            j = i + 1
            while j < len(lines) and lines[j].strip() != "```":
                j += 1
            marker = MARKER.match(lines[i - 1]) if i > 0 else None
            yield i + 1, marker.group(1) if marker else None, lines[i + 1:j], lines[j + 1:]
            i = j
        i += 1


def is_gap(line):
    return line == "" or line.startswith("...")


def line_pattern(line):
    parts = [re.escape(p) for p in line.split("...")]
    return re.compile("^" + ".*".join(parts) + "$")


def find_fragment(fragment, program):
    """None when the fragment's lines appear in `program` as the module docstring says, else the
    first fragment line that could not be placed."""
    wanted = [l.strip() for l in fragment]
    have = [l.strip() for l in program]
    # Runs of consecutive lines, split at gaps; each run must appear in order.
    runs, run = [], []
    for line in wanted:
        if is_gap(line):
            if run:
                runs.append(run)
            run = []
        else:
            run.append(line)
    if run:
        runs.append(run)
    start = 0
    for run in runs:
        patterns = [line_pattern(l) for l in run]
        found = None
        for at in range(start, len(have) - len(run) + 1):
            if all(p.match(have[at + k]) for k, p in enumerate(patterns)):
                found = at
                break
        if found is None:
            return run[0]
        start = found + len(run)
    return None


def check(root):
    failures = []
    count = {"program": 0, "fragment": 0}
    for name, path in documents(root):
        for line, marker, code, after in blocks(path):
            where = "%s:%d" % (name, line)
            if marker is None:
                failures.append(where + ": a C++ block without an example marker on the line above its fence "
                                "(<!-- example: program ... --> or <!-- example: fragment of examples/snippets/... -->)")
                continue
            program, fragment = PROGRAM.match(marker), FRAGMENT.match(marker)
            if program:
                count["program"] += 1
                text = program.group(3)
                following = "\n".join(after[:30])
                if text not in following:
                    failures.append('%s: the program is said to print "%s", but the text after the block does not '
                                    "say so" % (where, text))
                if not any("int main(" in l for l in code):
                    failures.append(where + ": a complete program has a main()")
            elif fragment:
                count["fragment"] += 1
                snippet = os.path.join(root, fragment.group(1))
                if not os.path.exists(snippet):
                    failures.append("%s: %s does not exist" % (where, fragment.group(1)))
                    continue
                with open(snippet, encoding="utf-8") as f:
                    missing = find_fragment(code, f.read().split("\n"))
                if missing is not None:
                    failures.append('%s: the fragment is not in %s as printed: from "%s" on, it differs (change '
                                    "both together)" % (where, fragment.group(1), missing))
            else:
                failures.append(where + ": unreadable example marker: " + marker)
    for f in failures:
        sys.stderr.write("doc_examples: FAILED: " + f + "\n")
    if failures:
        return 1
    print("doc_examples: %d complete programs and %d fragments, all as printed" % (count["program"], count["fragment"]))
    return 0


def extract(root, out):
    os.makedirs(out, exist_ok=True)
    for name, path in documents(root):
        for line, marker, code, _ in blocks(path):
            program = PROGRAM.match(marker or "")
            if not program:
                continue
            source = "// Extracted from %s:%d by tests/docs/doc_examples.py; edit the document, not this file.\n" % (
                name, line) + "\n".join(code) + "\n"
            target = os.path.join(out, program.group(1) + ".cpp")
            old = None
            if os.path.exists(target):
                with open(target, encoding="utf-8") as f:
                    old = f.read()
            if old != source:
                with open(target, "w", encoding="utf-8") as f:
                    f.write(source)
            print("%s|%s|%s" % (program.group(1), program.group(2).strip(), program.group(3)))
    return 0


def run(text, command):
    import subprocess
    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    sys.stdout.write(done.stdout)
    if done.returncode != 0:
        sys.stderr.write("doc_examples: FAILED: %s exited with %d\n" % (" ".join(command), done.returncode))
        return 1
    if text not in done.stdout:
        sys.stderr.write('doc_examples: FAILED: %s did not print "%s"\n' % (" ".join(command), text))
        return 1
    return 0


def main(argv):
    if len(argv) > 3 and argv[1] == "run":
        return run(argv[2], argv[3:])
    if len(argv) == 3 and argv[1] == "check":
        return check(argv[2])
    if len(argv) == 4 and argv[1] == "extract":
        return extract(argv[2], argv[3])
    sys.stderr.write(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
