"""llama-server as a child process and its HTTP API, with Python's standard library only.

Used by tests/llamacpp/test_llama_server.py and eval/server_passkey.py.
"""
import json
import socket
import subprocess
import time
import urllib.error
import urllib.request


class server_error(Exception):
    """The server did not start, or stopped: the message ends with its log's tail."""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def request(port, path, body=None, timeout=600):
    """(status, parsed JSON, or the text where it is no JSON) of a GET (body None) or a POST."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read().decode())
    except urllib.error.HTTPError as e:
        text = e.read().decode()
        try:
            return e.code, json.loads(text)
        except ValueError:
            return e.code, text


class running_server:
    """`with running_server(server, args, log_path) as port:` starts `server args` on 127.0.0.1
    at a free port, waits until /health answers 200 (at most `start_s`), and stops it on exit."""

    def __init__(self, server, args, log_path, start_s=300):
        self.cmd = [server, "--host", "127.0.0.1"] + list(args)
        self.log_path, self.start_s = log_path, start_s

    def log_tail(self, chars=6000):
        self.log.flush()
        with open(self.log_path) as f:
            return f.read()[-chars:]

    def __enter__(self):
        self.port = free_port()
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.cmd + ["--port", str(self.port)], stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + self.start_s
        while True:
            if self.proc.poll() is not None:
                tail = self.log_tail()  # before __exit__ closes the log
                self.__exit__(None, None, None)
                raise server_error(f"the server exited with {self.proc.returncode} before serving:\n{tail}")
            try:
                if request(self.port, "/health", timeout=5)[0] == 200:
                    return self.port
            except (urllib.error.URLError, ConnectionError, socket.timeout):
                pass
            if time.time() > deadline:
                tail = self.log_tail()
                self.__exit__(None, None, None)
                raise server_error(f"the server was not healthy after {self.start_s} s:\n{tail}")
            time.sleep(0.5)

    def __exit__(self, *exc):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return False
