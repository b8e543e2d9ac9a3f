"""Inductor's failures told in a line (stage_programs/compile.py): its first line and the first
compiler 'error:' line, not pages of g++ command line and warnings."""

from __future__ import annotations

from tokpipe_compiler.stage_programs.compile import compile_failed, gist

CPP = ("C++ compile error\n\nCommand:\ng++ /tmp/x.cpp -O3 -march=native " + "-I/x " * 400
       + "\n\nOutput:\n/tmp/x.cpp:12:5: error: 'foo' was not declared in this scope\n"
       + "warning: overflow\n" * 300)


def test_the_gist_is_the_first_line_and_the_compiler_error():
    said = gist(RuntimeError(CPP))
    assert said == ("RuntimeError: C++ compile error; /tmp/x.cpp:12:5: error: 'foo' was not "
                    "declared in this scope")


def test_the_failure_names_what_was_compiled_and_the_way_around():
    err = compile_failed("stage 1's graph for chunks of 4 token rows", "inductor",
                         RuntimeError(CPP))
    text = str(err)
    assert text.startswith("Inductor ('inductor') could not compile stage 1's graph for "
                           "chunks of 4 token rows: RuntimeError: C++ compile error")
    assert "compiler='eager'" in text and len(text) < 500
