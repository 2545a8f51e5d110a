"""What the launcher says of a process that died: its exit code and the last lines of its log (#14)."""
import subprocess
import sys

from wan_diloco.runtime.launch import Child, died, last_lines


def test_a_dead_child_is_reported_with_the_end_of_its_log(tmp_path):
    log = tmp_path / "learner-1.log"
    log.write_text("starting\n\n" + "".join(f"line {i}\n" for i in range(10)) +
                   "ValueError: data.corpus: /x: no such file or directory\n\n")
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    proc.wait()
    text = died(Child("learner-1", proc, log), lines=3)
    head, *tail = text.splitlines()
    assert head == f"learner-1 exited with code 3; the end of {log}:"
    assert tail == ["    line 8", "    line 9", "    ValueError: data.corpus: /x: no such file or directory"]
    assert last_lines(tmp_path / "absent.log", 3) == []
    empty = tmp_path / "syncer.log"
    empty.write_text("")
    assert died(Child("syncer", proc, empty)).endswith("(its log is empty)")
