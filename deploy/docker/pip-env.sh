# Sourced before each pip call of an image build's build stage
# (`. cbserve-pip-env`): a package mirror or a TLS-intercepting proxy,
# applied only where given, so the defaults build as before.
#   INDEX_URL        (build argument) pip's index, PyPI by default
#   EXTRA_INDEX_URL  (build argument) a second index searched as well
#   /usr/local/share/cbserve-build-ca/*.pem  CAs to trust on top of pip's
#                    own bundle: deploy/docker/build-ca/ of the build context
#                    (`make image IMAGE_CA_FILE=ca.pem` puts the file there)
# (TORCH_INDEX_URL, the index of torch alone, is read by the Dockerfile.)
if [ -n "${INDEX_URL:-}" ]; then export PIP_INDEX_URL="$INDEX_URL"; fi
if [ -n "${EXTRA_INDEX_URL:-}" ]; then export PIP_EXTRA_INDEX_URL="$EXTRA_INDEX_URL"; fi
if ls /usr/local/share/cbserve-build-ca/*.pem >/dev/null 2>&1; then
  CBSERVE_CA_BUNDLE=/usr/local/share/cbserve-ca-bundle.pem
  if [ ! -s "$CBSERVE_CA_BUNDLE" ]; then
    python -c "import pip._vendor.certifi as c; print(open(c.where()).read())" >"$CBSERVE_CA_BUNDLE"
    cat /usr/local/share/cbserve-build-ca/*.pem >>"$CBSERVE_CA_BUNDLE"
  fi
  export PIP_CERT="$CBSERVE_CA_BUNDLE" REQUESTS_CA_BUNDLE="$CBSERVE_CA_BUNDLE" SSL_CERT_FILE="$CBSERVE_CA_BUNDLE"
fi
