"""The programs that run as servers, and their command lines: dualrun's CPU engine (transformers_server.py), the
replica router (router.py, with rotation.py, routing.py, client_noise.py, and router_client.py, its control
protocol), the gloo weight-transfer plugin vLLM loads on its CPU build (gloo_plugin.py, gloo_transfer.py), and the
catalogue of engine command lines a separate role runs (commands.py). Starting, watching, restarting and stopping
them is dualrun/servers/'s job."""
