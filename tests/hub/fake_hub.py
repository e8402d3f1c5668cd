"""A loopback Hugging Face Hub: the part of the Hub's HTTP protocol that huggingface_hub speaks to push a model repo
(repo and branch creation, ``preupload``, the LFS batch API with upload and verify, the ndjson commit, also as a pull
request) and to pull it (``resolve``, model info), in memory, served on 127.0.0.1 by the standard
library. Errors carry the ``X-Error-Code`` the client maps to its exceptions; :meth:`FakeHub.fail` injects HTTP
errors and :attr:`FakeHub.requests` logs every request. The client must run with Xet off (``HF_HUB_DISABLE_XET``)."""
import base64
import fnmatch
import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Dict, List, Tuple
from urllib.parse import parse_qs, unquote, urlsplit

TOKEN = 'hf_loopback_write_token'
LFS_SUFFIXES = ('.safetensors', '.bin', '.png')  # stored in LFS, as the Hub stores weights and images


@dataclass
class Repo:
    private: bool
    refs: Dict[str, str] = field(default_factory=dict)  # branch or refs/pr/N -> commit
    commits: Dict[str, Dict[str, bytes]] = field(default_factory=dict)  # commit -> path -> content

    def commit(self, files: Dict[str, bytes], ref: str) -> str:
        sha = hashlib.sha1(f'{len(self.commits)}:{sorted(files)}'.encode()).hexdigest()
        self.commits[sha], self.refs[ref] = files, sha
        return sha


class HttpError(Exception):
    def __init__(self, status: int, message: str, code: str = '', headers: Dict[str, str] = None) -> None:
        super().__init__(message)
        self.status, self.headers = status, dict(headers or {}, **{'X-Error-Code': code} if code else {})


class FakeHub:
    """The Hub's state and its listener: ``with FakeHub() as hub:`` serves on ``hub.endpoint`` until the block ends."""

    def __init__(self) -> None:
        self.repos: Dict[str, Repo] = {}
        self.lfs: Dict[str, bytes] = {}  # sha256 -> content
        self.requests: List[Tuple[str, str, int]] = []  # method, path, status
        self.faults: List[Tuple[str, str, int]] = []  # method, path pattern, status
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(('127.0.0.1', 0), type('Handler', (Handler,), {'hub': self}))
        self.endpoint = f'http://127.0.0.1:{self.server.server_port}'

    def __enter__(self) -> 'FakeHub':
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, kwargs=dict(poll_interval=0.05), daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def fail(self, method: str, path: str, status: int, times: int = 1) -> None:
        """Answer the next ``times`` requests of ``method`` to a path matching the pattern ``path`` with ``status``."""
        self.faults += [(method, path, status)] * times

    def files(self, repo_id: str, revision: str = 'main') -> Dict[str, bytes]:
        repo = self.repos[repo_id]
        return repo.commits[repo.refs[revision]]


class Handler(BaseHTTPRequestHandler):
    protocol_version = 'HTTP/1.1'
    hub: FakeHub

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        self.serve()

    do_HEAD = do_POST = do_PUT = do_GET

    def serve(self) -> None:
        url = urlsplit(self.path)
        self.query, self.body = parse_qs(url.query), self.rfile.read(int(self.headers.get('Content-Length') or 0))
        with self.hub.lock:
            fault = next((f for f in self.hub.faults if f[0] == self.command and fnmatch.fnmatchcase(url.path, f[1])),
                         None)
            if fault:
                self.hub.faults.remove(fault)
        try:
            if fault:
                raise HttpError(fault[2], 'Injected fault')
            # split before unquoting: a revision is one quoted segment (refs%2Fpr%2F1)
            self.route(url.path.strip('/').split('/'))
        except HttpError as e:
            self.reply(e.status, json.dumps({'error': str(e)}).encode(), {'X-Error-Message': str(e), **e.headers})

    def reply(self, status: int, body: bytes = b'', headers: Dict[str, str] = None) -> None:
        self.hub.requests.append((self.command, urlsplit(self.path).path, status))
        self.send_response(status)
        for name, value in {'Content-Type': 'application/json', **(headers or {}),
                            'Content-Length': str(len(body))}.items():
            self.send_header(name, value)
        self.end_headers()
        if self.command != 'HEAD':
            self.wfile.write(body)

    def json(self, payload) -> None:
        self.reply(200, json.dumps(payload).encode())

    def repo(self, org: str, name: str, write: bool) -> Repo:
        auth = self.headers.get('Authorization')
        if (write or auth) and auth != f'Bearer {TOKEN}':
            raise HttpError(401, 'Invalid credentials in Authorization header')
        if f'{org}/{name}' not in self.hub.repos:
            raise HttpError(404, 'Repository not found', 'RepoNotFound')
        return self.hub.repos[f'{org}/{name}']

    def commit(self, repo: Repo, revision: str) -> str:
        revision = unquote(revision)
        if revision not in repo.refs and revision not in repo.commits:
            raise HttpError(404, f'Invalid rev id: {revision}', 'RevisionNotFound')
        return repo.refs.get(revision, revision)

    def route(self, parts: List[str]) -> None:
        hub, method = self.hub, self.command
        if parts == ['api', 'repos', 'create']:
            return self.create_repo()
        if parts == ['api', 'validate-yaml']:
            return self.json({'errors': [], 'warnings': []})
        if parts[:2] == ['api', 'models'] and len(parts) >= 4:
            org, name, action, args = parts[2], parts[3], parts[4:5], parts[5:]
            repo = self.repo(org, name, write=method == 'POST')
            if not action:  # model info
                files = repo.commits[repo.refs['main']]
                return self.json({'id': f'{org}/{name}', 'sha': repo.refs['main'], 'private': repo.private,
                                  'siblings': [{'rfilename': path} for path in sorted(files)]})
            if action == ['branch']:
                repo.refs.setdefault(unquote(args[0]), repo.refs['main'])
                return self.json({})
            if action == ['preupload']:
                files = repo.commits[self.commit(repo, args[0])]
                return self.json({'files': [{
                    'path': f['path'], 'shouldIgnore': False,
                    'uploadMode': 'lfs' if f['path'].endswith(LFS_SUFFIXES) else 'regular',
                    'oid': hashlib.sha256(files[f['path']]).hexdigest() if f['path'] in files else None,
                } for f in json.loads(self.body)['files']]})
            if action == ['commit']:
                return self.create_commit(f'{org}/{name}', repo, args[0])
        if parts[2:] == ['info', 'lfs', 'objects', 'batch']:
            self.repo(parts[0], parts[1][:-len('.git')], write=True)
            objects = [dict(o, actions={'upload': {'href': f'{hub.endpoint}/_lfs/{o["oid"]}'},
                                        'verify': {'href': f'{hub.endpoint}/_lfs/{o["oid"]}/verify'}})
                       for o in json.loads(self.body)['objects']]
            return self.json({'transfer': 'basic', 'objects': objects})
        if parts[0] == '_lfs' and method == 'PUT':
            hub.lfs[hashlib.sha256(self.body).hexdigest()] = self.body
            return self.reply(200)
        if parts[0] == '_lfs':  # verify
            return self.json({'success': parts[1] in hub.lfs})
        if len(parts) >= 5 and parts[2] == 'resolve':
            return self.resolve(self.repo(parts[0], parts[1], write=False), parts[3], '/'.join(map(unquote, parts[4:])))
        raise HttpError(404, f'No route for {method} {self.path}')

    def create_repo(self) -> None:
        payload = json.loads(self.body)
        repo_id = f'{payload["organization"]}/{payload["name"]}'
        if self.headers.get('Authorization') != f'Bearer {TOKEN}':
            raise HttpError(401, 'You must be authenticated to create a repo')
        with self.hub.lock:
            if repo_id in self.hub.repos:  # the client reads the url from the conflict's body too
                return self.reply(409, json.dumps({'error': 'Repo exists', 'url': f'{self.hub.endpoint}/{repo_id}'})
                                  .encode())
            repo = self.hub.repos[repo_id] = Repo(private=payload.get('visibility') == 'private')
            repo.commit({'.gitattributes': b'*.safetensors filter=lfs diff=lfs merge=lfs -text\n'}, 'main')
        self.json({'url': f'{self.hub.endpoint}/{repo_id}'})

    def create_commit(self, repo_id: str, repo: Repo, revision: str) -> None:
        files = dict(repo.commits[self.commit(repo, revision)])
        for line in map(json.loads, self.body.decode().splitlines()):
            if line['key'] == 'file':
                files[line['value']['path']] = base64.b64decode(line['value']['content'])
            elif line['key'] == 'lfsFile':
                files[line['value']['path']] = self.hub.lfs[line['value']['oid']]
        answer = {}
        with self.hub.lock:
            ref = unquote(revision)
            if self.query.get('create_pr') == ['1']:
                ref = f'refs/pr/{sum(r.startswith("refs/pr/") for r in repo.refs) + 1}'
                answer['pullRequestUrl'] = f'{self.hub.endpoint}/{repo_id}/discussions/{ref.rsplit("/", 1)[1]}'
            sha = repo.commit(files, ref)
        self.json(dict(answer, commitOid=sha, commitUrl=f'{self.hub.endpoint}/{repo_id}/commit/{sha}'))

    def resolve(self, repo: Repo, revision: str, path: str) -> None:
        commit = self.commit(repo, revision)
        if path not in repo.commits[commit]:
            raise HttpError(404, 'Entry not found', 'EntryNotFound', {'X-Repo-Commit': commit})
        data = repo.commits[commit][path]
        self.reply(200, data, {'X-Repo-Commit': commit, 'ETag': f'"{hashlib.sha256(data).hexdigest()}"',
                               'Content-Type': 'application/octet-stream'})
