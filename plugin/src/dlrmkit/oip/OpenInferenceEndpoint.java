package dlrmkit.oip;

import com.google.gson.Gson;
import com.google.gson.JsonArray;
import com.google.gson.JsonElement;
import com.google.gson.JsonObject;
import com.google.gson.JsonParser;
import java.io.File;
import java.io.IOException;
import java.io.OutputStream;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.util.ArrayList;
import java.util.List;
import java.util.Map;
import java.util.concurrent.ConcurrentHashMap;
import org.pytorch.serve.archive.model.ModelVersionNotFoundException;
import org.pytorch.serve.servingsdk.Context;
import org.pytorch.serve.servingsdk.ModelServerEndpoint;
import org.pytorch.serve.servingsdk.annotations.Endpoint;
import org.pytorch.serve.servingsdk.annotations.helpers.EndpointTypes;
import org.pytorch.serve.servingsdk.http.Request;
import org.pytorch.serve.servingsdk.http.Response;
import org.pytorch.serve.util.ConfigManager;
import org.pytorch.serve.wlm.Model;
import org.pytorch.serve.wlm.ModelManager;
import org.pytorch.serve.wlm.ModelVersionedRefs;
import org.pytorch.serve.wlm.WorkerState;
import org.pytorch.serve.wlm.WorkerThread;

/**
 * The whole Open Inference Protocol (KServe v2) on TorchServe's inference port, in the frontend's
 * own JVM: health, server and model metadata, readiness and Triton's model configuration
 * extension, answered from the frontend's real worker states and the archive's
 * oip-metadata.json (written by scripts/build_mar.py from the handler: config); infer and explain
 * go to the model's job queue exactly as TorchServe's own /v2 route sends them (StockInference).
 *
 * <p>TorchServe hands an endpoint plugin every request whose first path segment is its
 * urlPattern, so this class sees all of /v2, infer included.
 */
@Endpoint(
        urlPattern = "v2",
        endpointType = EndpointTypes.INFERENCE,
        description = "Open Inference Protocol v2: health, metadata, readiness, model config, infer")
public final class OpenInferenceEndpoint extends ModelServerEndpoint {
    /** The archive's v2 description: inputs, outputs, max_batch_size (scripts/build_mar.py). */
    static final String METADATA_FILE = "oip-metadata.json";
    static final String DELTA_STATE_DIR = "delta-state"; // dlrmkit/live/applier.py STATE_DIR

    static final String[] EXTENSIONS = {"binary_tensor_data", "model_configuration"};
    private static final Gson GSON = new Gson();
    private final Map<String, JsonObject> described = new ConcurrentHashMap<>();

    /**
     * TorchServe builds its plugins before its ModelManager: a daemon thread puts StockInference
     * in front of the frontend's task pool as soon as the ModelManager exists (model loading
     * comes before the inference port is bound, so before any request).
     */
    public OpenInferenceEndpoint() {
        Thread t =
                new Thread(
                        () -> {
                            while (!StockInference.install()) {
                                try {
                                    Thread.sleep(5);
                                } catch (InterruptedException e) {
                                    return;
                                }
                            }
                        },
                        "oip-install");
        t.setDaemon(true);
        t.start();
        Warmup.watch();
    }

    /** A path under /v2/models that names a model (and maybe a version) and what is asked. */
    static final class Target {
        final String name;
        final String version; // null: the default version
        final String action; // "" (metadata), ready, config, infer, explain

        Target(String name, String version, String action) {
            this.name = name;
            this.version = version;
            this.action = action;
        }
    }

    /** An answer other than 200, with its {"error": ...} body. */
    static final class Refusal extends Exception {
        private static final long serialVersionUID = 1L;
        final int status;

        Refusal(int status, String message) {
            super(message);
            this.status = status;
        }
    }

    @Override
    public void doGet(Request req, Response rsp, Context ctx) throws IOException {
        String[] p = segments(req);
        try {
            if (p.length == 0) {
                send(rsp, 200, serverMetadata());
            } else if (p.length == 2 && "health".equals(p[0]) && "live".equals(p[1])) {
                send(rsp, 200, field("live", true));
            } else if (p.length == 2 && "health".equals(p[0]) && "ready".equals(p[1])) {
                boolean ready = serverReady();
                send(rsp, ready ? 200 : 503, field("ready", ready));
            } else {
                Target t = target(p);
                Model model = model(t);
                switch (t.action) {
                    case "":
                        send(rsp, 200, modelMetadata(model));
                        break;
                    case "ready":
                        boolean ready = ready(model);
                        JsonObject body = field("name", model.getModelName());
                        body.addProperty("ready", ready);
                        JsonObject warming = Warmup.result(model);
                        if (!ready && warming != null && !Warmup.warm(model)) {
                            body.add("warm_up", warming); // loaded, being warmed (Warmup)
                        }
                        send(rsp, ready ? 200 : 503, body);
                        break;
                    case "config":
                        send(rsp, 200, modelConfig(model));
                        break;
                    default:
                        throw new Refusal(405, "GET " + path(req) + ": use POST");
                }
            }
        } catch (Refusal e) {
            send(rsp, e.status, field("error", e.getMessage()));
        }
    }

    @Override
    public void doPost(Request req, Response rsp, Context ctx) throws IOException {
        try {
            Target t = target(segments(req));
            if (!"infer".equals(t.action) && !"explain".equals(t.action)) {
                throw new Refusal(
                        t.action.isEmpty() || "ready".equals(t.action) || "config".equals(t.action)
                                ? 405
                                : 404,
                        "POST " + path(req) + ": only .../infer and .../explain take POST");
            }
            model(t); // an unknown model or version: 404
            // Infer never reaches here once StockInference is installed (it queues the job on
            // the event loop, before TorchServe runs this plugin with the body released).
            StockInference.install();
            throw new Refusal(503, "the server is starting: retry");
        } catch (Refusal e) {
            send(rsp, e.status, field("error", e.getMessage()));
        }
    }

    @Override
    public void doPut(Request req, Response rsp, Context ctx) throws IOException {
        send(rsp, 405, field("error", "PUT " + path(req) + ": the v2 API takes GET and POST"));
    }

    @Override
    public void doDelete(Request req, Response rsp, Context ctx) throws IOException {
        send(rsp, 405, field("error", "DELETE " + path(req) + ": the v2 API takes GET and POST"));
    }

    // --- answers ------------------------------------------------------------------------------

    private static JsonObject serverMetadata() {
        JsonObject body = field("name", "torchserve");
        body.addProperty("version", ConfigManager.getInstance().getVersion());
        JsonArray ext = new JsonArray();
        for (String e : EXTENSIONS) {
            ext.add(e);
        }
        body.add("extensions", ext);
        return body;
    }

    /** Every registered model's default version is ready. */
    static boolean serverReady() {
        boolean any = false;
        for (Map.Entry<String, ModelVersionedRefs> m : ModelManager.getInstance().getAllModels()) {
            Model model = m.getValue().getDefaultModel();
            if (model == null || !ready(model)) {
                return false;
            }
            any = true;
        }
        return any;
    }

    /** A worker has loaded the model and the frontend's path to it is warm (Warmup). */
    static boolean ready(Model model) {
        return readyWorkers(model) > 0 && Warmup.warm(model);
    }

    /** Workers that have loaded the model and take jobs: the management API's READY. */
    static int readyWorkers(Model model) {
        int ready = 0;
        for (WorkerThread w : ModelManager.getInstance().getWorkers(model.getModelVersionName())) {
            if (w.getState() == WorkerState.WORKER_MODEL_LOADED) {
                ready++;
            }
        }
        return ready;
    }

    private JsonObject modelMetadata(Model model) throws Refusal {
        JsonObject desc = description(model);
        JsonObject body = field("name", model.getModelName());
        body.add("versions", versions(model.getModelName()));
        body.addProperty("platform", "pytorch_torchserve");
        body.add("inputs", desc.has("inputs") ? desc.get("inputs") : new JsonArray());
        body.add("outputs", desc.has("outputs") ? desc.get("outputs") : new JsonArray());
        if (desc.has("parameters")) { // what the build recorded: the dense half's precision
            body.add("parameters", desc.get("parameters"));
        }
        addDeltaSequence(body, model);
        return body;
    }

    /**
     * Live updates (handler.delta_dir): each worker writes delta-state/PID.json in the model
     * directory with the delta sequence it serves. delta_sequence is the lowest among the live
     * workers (every answer is at least that fresh), delta_sequences each worker's, by pid.
     */
    private static void addDeltaSequence(JsonObject body, Model model) {
        File dir = new File(model.getModelDir(), DELTA_STATE_DIR);
        if (!dir.isDirectory()) {
            return;
        }
        JsonObject each = new JsonObject();
        long lowest = Long.MAX_VALUE;
        for (WorkerThread w : ModelManager.getInstance().getWorkers(model.getModelVersionName())) {
            File f = new File(dir, w.getPid() + ".json");
            if (w.getState() != WorkerState.WORKER_MODEL_LOADED || !f.isFile()) {
                continue;
            }
            try {
                JsonObject state =
                        JsonParser.parseString(
                                        new String(
                                                Files.readAllBytes(f.toPath()),
                                                StandardCharsets.UTF_8))
                                .getAsJsonObject();
                long seq = state.get("sequence").getAsLong();
                each.addProperty(Integer.toString(w.getPid()), seq);
                lowest = Math.min(lowest, seq);
            } catch (IOException | RuntimeException e) {
                // being replaced by the worker right now: left out of this answer
            }
        }
        if (lowest != Long.MAX_VALUE) {
            body.addProperty("delta_sequence", lowest);
            body.add("delta_sequences", each);
        }
    }

    /**
     * Triton's model configuration, from the same description: per input its data type and its
     * dims after the batch dimension (a [-1] input is dims [1] reshaped to [], as Triton spells
     * one value per row); dynamic batching from the model's batchSize / maxBatchDelay.
     */
    private JsonObject modelConfig(Model model) throws Refusal {
        JsonObject desc = description(model);
        JsonObject body = field("name", model.getModelName());
        body.addProperty("platform", "pytorch_torchserve");
        body.addProperty("backend", "torchserve");
        body.addProperty(
                "max_batch_size",
                desc.has("max_batch_size") ? desc.get("max_batch_size").getAsInt() : 0);
        body.add("input", tritonTensors(desc.getAsJsonArray("inputs")));
        body.add("output", tritonTensors(desc.getAsJsonArray("outputs")));
        if (model.getBatchSize() > 1) {
            JsonObject batching = new JsonObject();
            batching.addProperty(
                    "max_queue_delay_microseconds", model.getMaxBatchDelay() * 1000L);
            body.add("dynamic_batching", batching);
        }
        JsonObject group = field("kind", "KIND_CPU");
        group.addProperty("count", model.getMinWorkers());
        JsonArray groups = new JsonArray();
        groups.add(group);
        body.add("instance_group", groups);
        // TorchServe batches requests, Triton's max_batch_size counts rows: say both.
        JsonObject params = new JsonObject();
        params.add("torchserve_batch_size", stringValue(model.getBatchSize()));
        params.add("torchserve_max_batch_delay_ms", stringValue(model.getMaxBatchDelay()));
        body.add("parameters", params);
        return body;
    }

    private static JsonArray tritonTensors(JsonArray tensors) {
        JsonArray out = new JsonArray();
        if (tensors == null) {
            return out;
        }
        for (JsonElement e : tensors) {
            JsonObject t = e.getAsJsonObject();
            JsonObject c = field("name", t.get("name").getAsString());
            c.addProperty("data_type", "TYPE_" + t.get("datatype").getAsString());
            JsonArray shape = t.getAsJsonArray("shape");
            JsonArray dims = new JsonArray();
            for (int i = 1; i < shape.size(); i++) {
                dims.add(shape.get(i));
            }
            if (dims.size() == 0) {
                dims.add(1);
                JsonObject reshape = new JsonObject();
                reshape.add("shape", new JsonArray());
                c.add("reshape", reshape);
            }
            c.add("dims", dims);
            out.add(c);
        }
        return out;
    }

    /** oip-metadata.json of the model version's extracted archive, read once per archive. */
    private JsonObject description(Model model) throws Refusal {
        File file = new File(model.getModelDir(), METADATA_FILE);
        JsonObject desc = described.get(file.getPath());
        if (desc == null) {
            if (!file.isFile()) {
                throw new Refusal(
                        500,
                        model.getModelName()
                                + " "
                                + model.getVersion()
                                + ": its archive has no "
                                + METADATA_FILE
                                + " (rebuild it with scripts/build_mar.py)");
            }
            try {
                desc =
                        JsonParser.parseString(
                                        new String(
                                                Files.readAllBytes(file.toPath()),
                                                StandardCharsets.UTF_8))
                                .getAsJsonObject();
            } catch (IOException | RuntimeException e) {
                throw new Refusal(500, file + ": " + e.getMessage());
            }
            described.put(file.getPath(), desc);
        }
        return desc;
    }

    private static JsonArray versions(String name) {
        JsonArray out = new JsonArray();
        try {
            List<String> ids = new ArrayList<>();
            for (Map.Entry<String, Model> v : ModelManager.getInstance().getAllModelVersions(name)) {
                ids.add(v.getKey());
            }
            ids.sort(null);
            ids.forEach(out::add);
        } catch (org.pytorch.serve.archive.model.ModelNotFoundException e) {
            // unregistered between the lookup and now: no versions
        }
        return out;
    }

    // --- requests -----------------------------------------------------------------------------

    private static String path(Request req) {
        return path(req.getRequestURI());
    }

    private static String path(String uri) {
        int q = uri.indexOf('?');
        return q < 0 ? uri : uri.substring(0, q);
    }

    /** The path's segments after /v2 ("/v2/models/m/ready" -> models, m, ready). */
    private static String[] segments(Request req) {
        return segments(req.getRequestURI());
    }

    static String[] segments(String uri) {
        List<String> out = new ArrayList<>();
        for (String s : path(uri).split("/")) {
            if (!s.isEmpty()) {
                out.add(s);
            }
        }
        return out.subList(1, out.size()).toArray(new String[0]);
    }

    static Target target(String[] p) throws Refusal {
        if (p.length >= 2 && "models".equals(p[0])) {
            if (p.length == 2) {
                return new Target(p[1], null, "");
            }
            if (p.length == 3 && !"versions".equals(p[2])) {
                return new Target(p[1], null, p[2]);
            }
            if (p.length == 4 && "versions".equals(p[2])) {
                return new Target(p[1], p[3], "");
            }
            if (p.length == 5 && "versions".equals(p[2])) {
                return new Target(p[1], p[3], p[4]);
            }
        }
        throw new Refusal(
                404,
                "/v2/"
                        + String.join("/", p)
                        + ": not an Open Inference Protocol path (/v2, /v2/health/live|ready, "
                        + "/v2/models/{m}[/versions/{v}][/ready|/config|/infer])");
    }

    static Model model(Target t) throws Refusal {
        if (!t.action.isEmpty()
                && !"ready".equals(t.action)
                && !"config".equals(t.action)
                && !"infer".equals(t.action)
                && !"explain".equals(t.action)) {
            throw new Refusal(404, t.action + ": unknown; expected ready, config, infer or explain");
        }
        Model model;
        try {
            model = ModelManager.getInstance().getModel(t.name, t.version);
        } catch (ModelVersionNotFoundException e) {
            throw new Refusal(404, "model " + t.name + " has no version " + t.version);
        }
        if (model == null) {
            throw new Refusal(404, "model " + t.name + " is not registered");
        }
        return model;
    }

    // --- answers ------------------------------------------------------------------------------

    static JsonObject field(String name, Object value) {
        JsonObject o = new JsonObject();
        if (value instanceof Boolean) {
            o.addProperty(name, (Boolean) value);
        } else {
            o.addProperty(name, String.valueOf(value));
        }
        return o;
    }

    private static JsonObject stringValue(int value) {
        return field("string_value", value);
    }

    static void send(Response rsp, int status, JsonObject body) throws IOException {
        rsp.setStatus(status);
        rsp.setContentType("application/json");
        try (OutputStream out = rsp.getOutputStream()) {
            out.write(GSON.toJson(body).getBytes(StandardCharsets.UTF_8));
        }
    }
}
