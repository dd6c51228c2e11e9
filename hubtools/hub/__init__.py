"""A self-hosted kernel hub: the part of the Hugging Face Hub HTTP API that `huggingface_hub.HfApi` and `kernels`
use, served from git repositories in a data folder. One module per concern, each importing only those above it:

- `errors`: errors answered the Hub's way (status, error code, message);
- `storage`: the git-backed repo store and the checks on every name and path a client sends;
- `commits`: commit and preupload payloads parsed, and commits landed on a ref all-or-nothing;
- `api`: the routes, bound to their handler functions, and the replies, independent of the HTTP server;
- `server`: the HTTP server, the command line (`python scripts/hub.py --data DIR`) and `running_hub(data_dir)`.
"""
