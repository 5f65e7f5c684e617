# Test fixture: the few nixpkgs `lib` functions flake.nix uses, written on
# builtins (same names and results as nixpkgs' for the arguments used), so
# the flake's outputs evaluate offline with Nix 2.8. Not nixpkgs' code.
let
  splitString =
    sep: s: builtins.filter builtins.isString (builtins.split (escapeRegex sep) s);
  escapeRegex =
    s:
    builtins.replaceStrings
      [ "\\" "." "*" "+" "?" "(" ")" "[" "]" "{" "}" "|" "^" "$" ]
      [ "\\\\" "\\." "\\*" "\\+" "\\?" "\\(" "\\)" "\\[" "\\]" "\\{" "\\}" "\\|" "\\^" "\\$" ]
      s;
  trim =
    s:
    let
      m = builtins.match "[[:space:]]*(|.*[^[:space:]])[[:space:]]*" s;
    in
    if m == null then s else builtins.head m;
in
{
  inherit splitString trim;
  genAttrs =
    names: f:
    builtins.listToAttrs (
      map (n: {
        name = n;
        value = f n;
      }) names
    );
  optionals = cond: xs: if cond then xs else [ ];
  optionalString = cond: s: if cond then s else "";
  concatMapStrings = f: xs: builtins.concatStringsSep "" (map f xs);
  cmakeBool = name: value: "-D${name}:BOOL=${if value then "TRUE" else "FALSE"}";
  cmakeFeature = name: value: "-D${name}:STRING=${value}";
  getExe = drv: "${drv}/bin/${drv.meta.mainProgram}";
  licenses.mit = {
    spdxId = "MIT";
  };
  platforms.linux = [
    "x86_64-linux"
    "aarch64-linux"
  ];
}
