# Sourced before each pip call of an image build (`. cbserve-pip-env`): the
# build arguments for a package mirror or a TLS-intercepting proxy, applied
# only where they were given, so the defaults build as before.
#   INDEX_URL        pip's index (PyPI by default)
#   EXTRA_INDEX_URL  a second index searched as well
#   EXTRA_CA_CERT    PEM text of a CA to trust on top of pip's own bundle
# (TORCH_INDEX_URL, the torch wheel index, is read by the Dockerfile itself.)
if [ -n "${INDEX_URL:-}" ]; then export PIP_INDEX_URL="$INDEX_URL"; fi
if [ -n "${EXTRA_INDEX_URL:-}" ]; then export PIP_EXTRA_INDEX_URL="$EXTRA_INDEX_URL"; fi
if [ -n "${EXTRA_CA_CERT:-}" ]; then
  CBSERVE_CA_BUNDLE=/usr/local/share/cbserve-ca-bundle.pem
  if [ ! -s "$CBSERVE_CA_BUNDLE" ]; then
    python -c "import pip._vendor.certifi as c; print(open(c.where()).read())" >"$CBSERVE_CA_BUNDLE"
    printf '%s\n' "$EXTRA_CA_CERT" >>"$CBSERVE_CA_BUNDLE"
  fi
  export PIP_CERT="$CBSERVE_CA_BUNDLE" REQUESTS_CA_BUNDLE="$CBSERVE_CA_BUNDLE" SSL_CERT_FILE="$CBSERVE_CA_BUNDLE"
fi
