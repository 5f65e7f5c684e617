{
  description = "rollkv: llama.cpp with rolling KV (pinned upstream + patches/series)";

  # nixos-unstable as of 2026-06-29 (lastModified 1782723713); flake.lock
  # records its narHash. Move it with `nix flake update` and commit both files.
  inputs.nixpkgs.url = "github:NixOS/nixpkgs/b5aa0fbd538984f6e3d201be0005b4463d8b09f8";

  # Current nixpkgs needs Nix >= 2.18 to evaluate. The package itself is ./package.nix
  # (callPackage-able, `cudaSupport ? config.cudaSupport`); overlays.default adds it to any
  # nixpkgs as rollkv-llamafile.
  outputs =
    { self, nixpkgs }:
    let
      inherit (nixpkgs) lib;

      systems = [
        "x86_64-linux"
        "aarch64-linux"
      ];
      forAllSystems = f: lib.genAttrs systems f;

      pkgsFor =
        system: cuda:
        if cuda then
          import nixpkgs {
            inherit system;
            config = {
              allowUnfree = true; # the CUDA toolkit's licence
              cudaSupport = true;
            };
          }
        else
          nixpkgs.legacyPackages.${system};

      python = pkgs: pkgs.python3.withPackages (ps: [
        ps.requests
        ps.nvidia-ml-py
        ps.numpy
        ps.matplotlib
      ]);

      # `rollkv` from this checkout, with the CUDA build's programs on PATH
      rollkvTool =
        pkgs: llamafile:
        pkgs.writeShellApplication {
          name = "rollkv";
          runtimeInputs = [
            (python pkgs)
            llamafile
          ];
          text = ''
            export PYTHONPATH=${self}''${PYTHONPATH:+:$PYTHONPATH}
            exec python3 -m rollkv_dist "$@"
          '';
        };
    in
    {
      # `pkgs.rollkv-llamafile` for any nixpkgs: CUDA follows that nixpkgs' config.cudaSupport
      overlays.default = final: prev: {
        rollkv-llamafile = final.callPackage ./package.nix { };
      };

      packages = forAllSystems (
        system:
        let
          cpu = (pkgsFor system false).callPackage ./package.nix { cudaSupport = false; };
          cuda = (pkgsFor system true).callPackage ./package.nix { cudaSupport = true; };
          launcher = llamafile: (pkgsFor system false).callPackage ./nix/launcher.nix { inherit llamafile; };
        in
        {
          default = cuda;
          inherit cpu cuda;
          # what `nix run` starts: llama-server with the host's NVIDIA driver found outside
          # NixOS (nixGL-style), and a usage line instead of a model-less server
          server = launcher cuda;
          server-cpu = launcher cpu;
          # the patched llama.cpp tree the package was built from (gguf-py and the qwen2
          # vocab for the gates' random-weight models)
          llama-tree = (pkgsFor system false).srcOnly cuda;
          rollkv = rollkvTool (pkgsFor system true) cuda;
          # `nix run .#gates -- [rollkv gates options]`: the GPU gates against the CUDA build
          # (--build) and its source (--llama-tree)
          gates = (pkgsFor system false).writeShellApplication {
            name = "rollkv-gates";
            runtimeInputs = [ self.packages.${system}.rollkv ];
            text = ''exec rollkv gates --build ${cuda} --llama-tree ${self.packages.${system}.llama-tree} "$@"'';
          };
        }
      );

      apps = forAllSystems (
        system:
        let
          pkgs = self.packages.${system};
        in
        {
          default = {
            type = "app";
            program = lib.getExe pkgs.server;
          };
          cpu = {
            type = "app";
            program = lib.getExe pkgs.server-cpu;
          };
          gates = {
            type = "app";
            program = lib.getExe pkgs.gates;
          };
        }
      );

      devShells = forAllSystems (
        system:
        let
          pkgs = pkgsFor system true;
        in
        {
          default = pkgs.mkShell {
            inputsFrom = [ self.packages.${system}.cuda ];
            packages = [
              (pkgs.python3.withPackages (ps: [
                ps.requests
                ps.nvidia-ml-py
                ps.numpy
                ps.matplotlib
                ps.pytest
                ps.nox
                ps.jinja2
                ps.pyyaml
              ]))
              pkgs.git
            ];
            shellHook = ''
              export CUDA_DEVICE_ORDER=PCI_BUS_ID
            '';
          };
        }
      );

      checks = forAllSystems (
        system:
        let
          pkgs = pkgsFor system false;
          cpu = self.packages.${system}.cpu;
        in
        {
          inherit cpu;
          # the conda recipe's own test, run against the Nix build
          recipe-test = pkgs.runCommand "rollkv-llamafile-recipe-test" { } ''
            PREFIX=${cpu} bash ${./recipe/run_test.sh}
            touch $out
          '';
        }
      );
    };
}
