"""A loopback Hugging Face Hub: the HTTP protocol huggingface_hub speaks to push and pull model repos, served on
127.0.0.1 with the standard library, in memory.

Two listeners, like the real Hub: the API (``endpoint``) and a CDN on another origin that serves LFS files, to which
``resolve`` redirects. Pushing covers repo creation, branches, ``preupload``, the LFS batch API with upload and
verify, and the ndjson commit (also as a pull request). Pulling covers ``resolve`` (HEAD and GET, with the
``X-Repo-Commit``, ``ETag``, ``X-Linked-Etag`` and ``X-Linked-Size`` headers, ranges), model info and the tree.
Errors carry the ``X-Error-Code`` header the client maps to its exceptions.

Tests inject faults (:meth:`FakeHub.fail`) and read every request in :attr:`FakeHub.requests`.
"""
import base64
import fnmatch
import hashlib
import itertools
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Dict, List, NamedTuple, Optional
from urllib.parse import parse_qs, unquote, urlsplit

TOKEN = 'hf_loopback_write_token'
USER = 'tester'
LFS_SUFFIXES = ('.safetensors', '.bin', '.pt', '.pth', '.pth.tar', '.png')
LFS_MIN_SIZE = 10 * 1024 * 1024
FAULTS = ('status', 'drop', 'truncate', 'short', 'wrong_etag')


@dataclass(frozen=True)
class Blob:
    data: bytes
    lfs: bool

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    @property
    def git_sha1(self) -> str:
        return hashlib.sha1(b'blob %d\0' % len(self.data) + self.data).hexdigest()

    @property
    def etag(self) -> str:
        """What the Hub sends as the file's ETag: the sha256 of an LFS file, the git blob id of a regular one."""
        return self.sha256 if self.lfs else self.git_sha1


@dataclass
class Repo:
    private: bool
    gated: bool = False  # readers must log in (and be granted access, which everyone with our token is)
    refs: Dict[str, str] = field(default_factory=dict)  # branch or refs/pr/N -> commit
    commits: Dict[str, Dict[str, Blob]] = field(default_factory=dict)  # commit -> files
    pull_requests: int = 0

    def resolve(self, revision: str) -> Optional[str]:
        if revision in self.refs:
            return self.refs[revision]
        return revision if revision in self.commits else None


class Fault(NamedTuple):
    method: str
    path: str  # fnmatch pattern
    kind: str
    status: int


class Request(NamedTuple):
    method: str
    path: str
    status: int


class HttpError(Exception):
    def __init__(self, status: int, message: str, code: Optional[str] = None, commit: Optional[str] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.commit = status, message, code, commit


class FakeHub:
    """The Hub's state and its two listeners. ``with FakeHub() as hub:`` serves on free ports until the block ends."""

    def __init__(self) -> None:
        self.repos: Dict[str, Repo] = {}
        self.lfs: Dict[str, bytes] = {}  # sha256 -> content
        self.requests: List[Request] = []
        self.faults: List[Fault] = []
        self.upload_mode = 'auto'  # 'auto': binary or large files go to LFS; 'regular': every file in the commit
        self._lock = threading.Lock()
        self._commit_ids = itertools.count()
        self._api = ThreadingHTTPServer(('127.0.0.1', 0), _handler(self, cdn=False))
        self._cdn = ThreadingHTTPServer(('127.0.0.1', 0), _handler(self, cdn=True))
        self.endpoint = f'http://127.0.0.1:{self._api.server_port}'
        self.cdn = f'http://127.0.0.1:{self._cdn.server_port}'

    def __enter__(self) -> 'FakeHub':
        for server in (self._api, self._cdn):
            server.daemon_threads = True
            threading.Thread(target=server.serve_forever, kwargs=dict(poll_interval=0.05), daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        for server in (self._api, self._cdn):
            server.shutdown()
            server.server_close()

    def fail(self, method: str, path: str, kind: str, times: int = 1, status: int = 500) -> None:
        """Answer the next ``times`` requests matching ``method`` and the ``path`` pattern with a fault:

        * ``status``: an HTTP error ``status`` (500 by default), no body to speak of;
        * ``drop``: close the connection without answering;
        * ``truncate``: announce the whole body, send half of it and close the connection;
        * ``short``: a complete answer with only half the body;
        * ``wrong_etag``: (``resolve``) announce an ETag and linked ETag that are not the content's hash.
        """
        assert kind in FAULTS, kind
        self.faults.extend([Fault(method, path, kind, status)] * times)

    def reset(self) -> None:
        """Forget faults and requests; keep the repos."""
        self.faults.clear()
        self.requests.clear()
        self.upload_mode = 'auto'

    def take_fault(self, method: str, path: str) -> Optional[Fault]:
        with self._lock:
            for i, fault in enumerate(self.faults):
                if fault.method == method and fnmatch.fnmatchcase(path, fault.path):
                    return self.faults.pop(i)
        return None

    def new_commit(self, repo: Repo, files: Dict[str, Blob], ref: str) -> str:
        sha = hashlib.sha1(f'{next(self._commit_ids)}:{sorted(files)}'.encode()).hexdigest()
        repo.commits[sha] = files
        repo.refs[ref] = sha
        return sha

    def create_repo(self, repo_id: str, private: bool = False, gated: bool = False) -> Repo:
        repo = self.repos[repo_id] = Repo(private=private, gated=gated)
        self.new_commit(repo, {'.gitattributes': Blob(b'*.safetensors filter=lfs diff=lfs merge=lfs -text\n', False)},
                        'main')
        return repo

    def publish(self, repo_id: str, files: Dict[str, bytes], private: bool = False, gated: bool = False) -> str:
        """Commit ``files`` to the main branch of ``repo_id`` (created if missing) from the server side, as a push
        of another tool would leave them; returns the commit."""
        with self._lock:
            repo = self.repos.get(repo_id) or self.create_repo(repo_id, private, gated)
            blobs = {path: Blob(data, is_lfs(path, len(data), data[:512])) for path, data in files.items()}
            for blob in blobs.values():
                if blob.lfs:
                    self.lfs[blob.sha256] = blob.data
            return self.new_commit(repo, {**repo.commits[repo.refs['main']], **blobs}, 'main')

    def files(self, repo_id: str, revision: str = 'main') -> Dict[str, bytes]:
        """The content of every file of ``repo_id`` at ``revision``."""
        repo = self.repos[repo_id]
        return {path: blob.data for path, blob in repo.commits[repo.resolve(revision)].items()}


def is_lfs(path: str, size: int, sample: bytes) -> bool:
    """Whether the Hub stores a file in LFS: weights, images, other binary files (NUL bytes in the first 512 bytes)
    and large files."""
    return path.endswith(LFS_SUFFIXES) or size >= LFS_MIN_SIZE or b'\0' in sample


def _handler(hub: FakeHub, cdn: bool) -> type:
    class Handler(_HubHandler):
        pass

    Handler.hub, Handler.is_cdn = hub, cdn
    return Handler


class _HubHandler(BaseHTTPRequestHandler):
    protocol_version = 'HTTP/1.1'
    hub: FakeHub
    is_cdn: bool

    def log_message(self, *args) -> None:
        pass

    # --- plumbing -----------------------------------------------------------------------------------------------------

    def do_GET(self) -> None:
        self._serve('GET')

    def do_HEAD(self) -> None:
        self._serve('HEAD')

    def do_POST(self) -> None:
        self._serve('POST')

    def do_PUT(self) -> None:
        self._serve('PUT')

    def _serve(self, method: str) -> None:
        url = urlsplit(self.path)
        self.method, self.url_path, self.query = method, url.path, parse_qs(url.query)
        self.body = self._read_body()
        self.fault = self.hub.take_fault(method, url.path)
        if self.fault is not None and self.fault.kind == 'drop':
            self.hub.requests.append(Request(method, url.path, 0))
            self.close_connection = True
        elif self.fault is not None and self.fault.kind == 'status':
            self._reply(self.fault.status, json.dumps({'error': 'Injected fault'}).encode())
        else:
            try:
                # Split before unquoting: revisions arrive quoted as one segment (refs%2Fpr%2F1), paths keep '/'.
                (self._cdn_routes if self.is_cdn else self._api_routes)(method, url.path.strip('/').split('/'))
            except HttpError as e:
                self._error(e)
            except Exception as e:  # a bug of this server: say so in the answer
                self._error(HttpError(500, f'{type(e).__name__}: {e}'))

    def _error(self, e: HttpError) -> None:
        headers = {'X-Error-Message': e.message}
        if e.code:
            headers['X-Error-Code'] = e.code
        if e.commit:
            headers['X-Repo-Commit'] = e.commit
        self._reply(e.status, json.dumps({'error': e.message}).encode(), headers)

    def _read_body(self) -> bytes:
        if self.headers.get('Transfer-Encoding', '').lower() == 'chunked':
            chunks = []
            while True:
                size = int(self.rfile.readline().strip(), 16)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
                if size == 0:
                    return b''.join(chunks)
        return self.rfile.read(int(self.headers.get('Content-Length') or 0))

    def _reply(self, status: int, body: bytes = b'', headers: Optional[dict] = None) -> None:
        """Send a response, to a HEAD without its body, cut short by a ``short`` or ``truncate`` fault."""
        kind = self.fault.kind if self.fault is not None and status < 300 and self.method == 'GET' else None
        if kind == 'short':
            body = body[:len(body) // 2]
        self.hub.requests.append(Request(self.method, self.url_path, status))
        self.send_response(status)
        headers = {'Content-Type': 'application/json', **(headers or {}), 'Content-Length': str(len(body))}
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        if self.method == 'HEAD':
            return
        if kind == 'truncate':
            body = body[:len(body) // 2]
            self.close_connection = True
        self.wfile.write(body)

    def _json(self, payload) -> None:
        self._reply(200, json.dumps(payload).encode())

    def _token(self) -> Optional[str]:
        auth = self.headers.get('Authorization', '')
        return auth[len('Bearer '):] if auth.startswith('Bearer ') else None

    def _check_token(self, write: bool) -> bool:
        """Whether the request carries our token; a wrong token is refused whatever the request."""
        token = self._token()
        if token is not None and token != TOKEN:
            raise HttpError(401, 'Invalid credentials in Authorization header')
        if write and token is None:
            raise HttpError(401, 'You must be authenticated to access this resource')
        return token is not None

    def _repo(self, org: str, name: str, write: bool = False) -> Repo:
        authenticated = self._check_token(write)
        repo = self.hub.repos.get(f'{org}/{name}')
        if repo is None or (repo.private and not authenticated):
            # Like the Hub: without credentials a private repo and a missing one look alike (401); with them, 404.
            raise HttpError(404 if authenticated else 401, 'Repository not found', 'RepoNotFound')
        if repo.gated and not authenticated:
            raise HttpError(401, 'Access to this model is restricted: log in to ask for it', 'GatedRepo')
        return repo

    def _commit(self, repo: Repo, revision: str) -> str:
        commit = repo.resolve(unquote(revision))
        if commit is None:
            raise HttpError(404, f'Invalid rev id: {unquote(revision)}', 'RevisionNotFound')
        return commit

    # --- API ----------------------------------------------------------------------------------------------------------

    def _api_routes(self, method: str, parts: List[str]) -> None:
        hub = self.hub
        if parts[:1] == ['api']:
            rest = parts[1:]
            if rest == ['repos', 'create'] and method == 'POST':
                return self._create_repo()
            if rest == ['validate-yaml'] and method == 'POST':
                return self._json({'errors': [], 'warnings': []})
            if rest == ['whoami-v2'] and method == 'GET':
                self._check_token(write=True)
                return self._json({'type': 'user', 'name': USER, 'orgs': [], 'auth': {'type': 'access_token'}})
            if rest == ['agent-harnesses']:
                return self._json({'standardEnvVars': [], 'harnesses': {}})
            if len(rest) >= 3 and rest[0] == 'models':
                org, name, action, args = rest[1], rest[2], rest[3:4], rest[4:]
                repo = self._repo(org, name, write=method == 'POST')
                if not action and method == 'GET':
                    return self._model_info(org, name, repo, 'main')
                if action == ['revision'] and method == 'GET':
                    return self._model_info(org, name, repo, args[0])
                if action == ['tree'] and method == 'GET':
                    return self._tree(repo, args[0], '/'.join(unquote(p) for p in args[1:]))
                if action == ['branch'] and method == 'POST':
                    return self._create_branch(repo, unquote(args[0]))
                if action == ['preupload'] and method == 'POST':
                    return self._preupload(repo, args[0])
                if action == ['commit'] and method == 'POST':
                    return self._create_commit(org, name, repo, args[0])
        if len(parts) == 6 and parts[1].endswith('.git') and parts[2:] == ['info', 'lfs', 'objects', 'batch']:
            self._repo(parts[0], parts[1][:-len('.git')], write=True)
            return self._lfs_batch()
        if parts[:1] == ['_lfs'] and len(parts) == 2 and method == 'PUT':
            return self._lfs_upload(parts[1])
        if parts[:1] == ['_lfs'] and parts[2:] == ['verify'] and method == 'POST':
            self._check_token(write=True)
            if parts[1] not in hub.lfs:
                raise HttpError(404, 'Object not uploaded')
            return self._json({'success': True})
        if len(parts) >= 5 and parts[2] == 'resolve' and method in ('GET', 'HEAD'):
            return self._resolve(self._repo(parts[0], parts[1]), parts[3], '/'.join(map(unquote, parts[4:])))
        raise HttpError(404, f'No route for {method} /{"/".join(parts)}')

    def _create_repo(self) -> None:
        self._check_token(write=True)
        payload = json.loads(self.body)
        repo_id = f'{payload.get("organization") or USER}/{payload["name"]}'
        with self.hub._lock:
            if repo_id in self.hub.repos:
                # The Hub says where the repo is in the body of the conflict too; the client reads it.
                return self._reply(409, json.dumps({'error': 'You already created this model repo',
                                                    'url': f'{self.hub.endpoint}/{repo_id}'}).encode())
            private = payload.get('visibility') == 'private' or bool(payload.get('private'))
            self.hub.create_repo(repo_id, private=private)
        self._json({'url': f'{self.hub.endpoint}/{repo_id}', 'name': repo_id, 'id': repo_id})

    def _create_branch(self, repo: Repo, branch: str) -> None:
        with self.hub._lock:
            if branch in repo.refs:
                raise HttpError(409, f'Reference already exists: {branch}')
            start = json.loads(self.body or b'{}').get('startingPoint') or 'main'
            repo.refs[branch] = self._commit(repo, start)
        self._json({})

    def _model_info(self, org: str, name: str, repo: Repo, revision: str) -> None:
        commit = self._commit(repo, revision)
        files = repo.commits[commit]
        self._json({
            'id': f'{org}/{name}', 'modelId': f'{org}/{name}', 'sha': commit, 'private': repo.private,
            'library_name': 'timm', 'tags': [], 'siblings': [{'rfilename': path} for path in sorted(files)],
        })

    def _tree(self, repo: Repo, revision: str, prefix: str) -> None:
        files = repo.commits[self._commit(repo, revision)]
        recursive = self.query.get('recursive', ['false'])[0].lower() == 'true'
        entries, folders = [], set()
        for path, blob in sorted(files.items()):
            if prefix and not path.startswith(prefix + '/'):
                continue
            rel = path[len(prefix) + 1:] if prefix else path
            if '/' in rel and not recursive:
                folders.add(f'{prefix}/{rel.split("/")[0]}'.strip('/'))
                continue
            entry = {'type': 'file', 'path': path, 'size': len(blob.data), 'oid': blob.git_sha1}
            if blob.lfs:
                entry['lfs'] = {'oid': blob.sha256, 'size': len(blob.data), 'pointerSize': 134}
            entries.append(entry)
        entries += [{'type': 'directory', 'path': f, 'oid': hashlib.sha1(f.encode()).hexdigest()} for f in folders]
        self._json(entries)

    def _preupload(self, repo: Repo, revision: str) -> None:
        files = repo.commits[self._commit(repo, revision)]
        out = []
        for f in json.loads(self.body)['files']:
            lfs = self.hub.upload_mode == 'auto' and is_lfs(f['path'], f['size'], base64.b64decode(f['sample']))
            remote = files.get(f['path'])
            out.append({
                'path': f['path'], 'uploadMode': 'lfs' if lfs else 'regular', 'shouldIgnore': False,
                'oid': remote.etag if remote is not None and remote.lfs == lfs else None,
            })
        self._json({'files': out})

    def _lfs_batch(self) -> None:
        payload = json.loads(self.body)
        objects = []
        for obj in payload['objects']:
            out = {'oid': obj['oid'], 'size': obj['size']}
            if obj['oid'] not in self.hub.lfs:
                out['actions'] = {
                    'upload': {'href': f'{self.hub.endpoint}/_lfs/{obj["oid"]}'},
                    'verify': {'href': f'{self.hub.endpoint}/_lfs/{obj["oid"]}/verify'},
                }
            objects.append(out)
        self._reply(200, json.dumps({'transfer': 'basic', 'objects': objects}).encode(),
                    {'Content-Type': 'application/vnd.git-lfs+json'})

    def _lfs_upload(self, oid: str) -> None:
        if hashlib.sha256(self.body).hexdigest() != oid:
            raise HttpError(400, 'Uploaded content does not match its oid')
        self.hub.lfs[oid] = self.body
        self._reply(200)

    def _create_commit(self, org: str, name: str, repo: Repo, revision: str) -> None:
        lines = [json.loads(line) for line in self.body.decode().splitlines() if line.strip()]
        with self.hub._lock:
            head = self._commit(repo, revision)
            files = dict(repo.commits[head])
            for line in lines:
                key, value = line['key'], line['value']
                if key == 'header':
                    parent = value.get('parentCommit')
                    if parent is not None and parent != head:
                        raise HttpError(412, 'A commit has happened since. Please refresh and try again.')
                elif key == 'file':
                    files[value['path']] = Blob(base64.b64decode(value['content']), lfs=False)
                elif key == 'lfsFile':
                    data = self.hub.lfs.get(value['oid'])
                    if data is None or len(data) != value['size']:
                        raise HttpError(422, f'LFS object {value["oid"]} was not uploaded')
                    files[value['path']] = Blob(data, lfs=True)
                elif key == 'deletedFile':
                    files.pop(value['path'], None)
                elif key == 'deletedFolder':
                    files = {p: b for p, b in files.items() if not p.startswith(value['path'].rstrip('/') + '/')}
            answer = {}
            if self.query.get('create_pr') == ['1']:
                repo.pull_requests += 1
                ref = f'refs/pr/{repo.pull_requests}'
                answer['pullRequestUrl'] = f'{self.hub.endpoint}/{org}/{name}/discussions/{repo.pull_requests}'
            else:
                ref = unquote(revision)
                if ref not in repo.refs:
                    raise HttpError(400, 'Commits go to a branch')
            sha = self.hub.new_commit(repo, files, ref)
        self._json(dict(answer, commitOid=sha, commitUrl=f'{self.hub.endpoint}/{org}/{name}/commit/{sha}'))

    def _resolve(self, repo: Repo, revision: str, path: str) -> None:
        commit = self._commit(repo, revision)
        blob = repo.commits[commit].get(path)
        if blob is None:
            raise HttpError(404, 'Entry not found', 'EntryNotFound', commit=commit)
        etag = blob.etag
        if self.fault is not None and self.fault.kind == 'wrong_etag':  # a hash of the right kind, of other content
            etag = (hashlib.sha256 if blob.lfs else hashlib.sha1)(b'not ' + blob.data).hexdigest()
        headers = {'X-Repo-Commit': commit, 'ETag': f'"{etag}"', 'Accept-Ranges': 'bytes'}
        if blob.lfs:
            # Like the Hub: LFS files redirect to the CDN, whose response carries the linked ETag and size.
            headers.update({'X-Linked-Etag': f'"{etag}"', 'X-Linked-Size': str(len(blob.data)),
                            'Location': f'{self.hub.cdn}/_cdn/{blob.sha256}'})
            self._reply(302, b'', headers)
        else:
            self._send_content(blob.data, headers)

    # --- CDN ----------------------------------------------------------------------------------------------------------

    def _cdn_routes(self, method: str, parts: List[str]) -> None:
        if len(parts) != 2 or parts[0] != '_cdn' or method not in ('GET', 'HEAD') or parts[1] not in self.hub.lfs:
            raise HttpError(404, 'Not found')
        data = self.hub.lfs[parts[1]]
        self._send_content(data, {'ETag': f'"{parts[1]}"', 'Accept-Ranges': 'bytes'})

    def _send_content(self, data: bytes, headers: dict) -> None:
        headers = dict(headers, **{'Content-Type': 'application/octet-stream'})
        ranged = self.headers.get('Range', '')
        if ranged.startswith('bytes=') and ranged.endswith('-'):
            start = int(ranged[len('bytes='):-1])
            headers['Content-Range'] = f'bytes {start}-{len(data) - 1}/{len(data)}'
            body, status = data[start:], 206
        else:
            body, status = data, 200
        self._reply(status, body, headers)
