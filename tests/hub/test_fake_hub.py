"""The loopback Hub answers ``resolve`` as the Hub does: the headers huggingface_hub relies on, LFS files through a
redirect to a CDN on another origin, errors with their ``X-Error-Code``."""
import hashlib
import http.client
from urllib.parse import urlsplit


def head(url: str) -> http.client.HTTPResponse:
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port)
    connection.request('HEAD', parts.path)
    return connection.getresponse()


def test_resolve_headers(fresh_hub):
    weights, config = b'\0weights' * 100, b'{"architecture": "vit_hyperbf_tiny"}'
    commit = fresh_hub.publish('fake/resolve', {'model.safetensors': weights, 'config.json': config})

    lfs = head(f'{fresh_hub.endpoint}/fake/resolve/resolve/main/model.safetensors')
    assert lfs.status == 302 and lfs.headers['X-Repo-Commit'] == commit
    assert lfs.headers['X-Linked-Etag'] == f'"{hashlib.sha256(weights).hexdigest()}"'
    assert lfs.headers['X-Linked-Size'] == str(len(weights))
    assert lfs.headers['Location'].startswith(fresh_hub.cdn) and fresh_hub.cdn != fresh_hub.endpoint

    regular = head(f'{fresh_hub.endpoint}/fake/resolve/resolve/{commit}/config.json')
    git_blob_id = hashlib.sha1(b'blob %d\0' % len(config) + config).hexdigest()
    assert regular.status == 200 and regular.headers['ETag'] == f'"{git_blob_id}"'
    assert regular.headers['X-Repo-Commit'] == commit and regular.headers['Content-Length'] == str(len(config))


def test_resolve_errors(fresh_hub):
    commit = fresh_hub.publish('fake/errors', {'config.json': b'{}'})
    for path, status, code in [
        ('/fake/missing/resolve/main/config.json', 401, 'RepoNotFound'),  # anonymous: missing or private
        ('/fake/errors/resolve/v9/config.json', 404, 'RevisionNotFound'),
        ('/fake/errors/resolve/main/weights.bin', 404, 'EntryNotFound'),
    ]:
        response = head(fresh_hub.endpoint + path)
        assert (response.status, response.headers['X-Error-Code']) == (status, code), path
    assert head(f'{fresh_hub.endpoint}/fake/errors/resolve/main/weights.bin').headers['X-Repo-Commit'] == commit
